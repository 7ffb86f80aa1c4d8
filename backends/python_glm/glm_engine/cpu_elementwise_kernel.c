/* The element-wise work of a decoder layer on the CPU, one pass each: RMSNorm (with the residual addition before
 * it), SiLU(gate) * up, and the rotary embedding of queries and keys with the store of keys and values into the KV
 * cache. In torch each is five or more operators, each its own pass over memory and its own
 * dispatch: microseconds apiece, which add up at decode sizes (docs/performance.md).
 *
 * Built and loaded by cpu_elementwise_kernel.py (compiled for the CPU it runs on: c_kernels.py). Float32; rows are
 * shared out between threads only when there are enough of them to pay for waking the threads.
 */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Below this many elements, one thread: a decode step's rows take microseconds, a parallel region about as long. */
#define PARALLEL_ELEMENTS 65536

/* out = x / sqrt(mean(x^2) + eps) * weight, row by row, where x = input + residual when residual is not NULL (the
 * sum then also written to sum_out: the residual stream's next value). input, residual, out, sum_out: [rows, cols],
 * contiguous; out and sum_out are fresh buffers. */
void rms_norm_f32(float *restrict out, float *restrict sum_out, const float *input, const float *residual,
                  const float *weight, int64_t rows, int64_t cols, float eps, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = input + r * cols;
        if (residual != NULL) {
            float *sum = sum_out + r * cols;
            const float *res = residual + r * cols;
            for (int64_t c = 0; c < cols; c++)
                sum[c] = x[c] + res[c];
            x = sum;
        }
        float squares = 0.0f;
        for (int64_t c = 0; c < cols; c++)
            squares += x[c] * x[c];
        const float inverse = 1.0f / sqrtf(squares / (float)cols + eps);
        float *o = out + r * cols;
        for (int64_t c = 0; c < cols; c++)
            o[c] = x[c] * inverse * weight[c];
    }
}

/* out[r, c] = silu(gate_up[r, c]) * gate_up[r, cols + c]: the gate and up halves of a fused projection's rows
 * ([rows, 2 * cols], contiguous) into out ([rows, cols]). */
void silu_and_mul_f32(float *restrict out, const float *gate_up, int64_t rows, int64_t cols, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) if (rows * cols >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * cols, *up = gate + cols;
        float *o = out + r * cols;
        for (int64_t c = 0; c < cols; c++)
            o[c] = gate[c] / (1.0f + expf(-gate[c])) * up[c];
    }
}

/* The rotary embedding of a layer's new queries and keys, then its new keys and values stored in the KV cache. qkv:
 * [tokens, heads + 2 * kv_heads, head_dim], contiguous (the fused projection's output, rotated in place): the first
 * rotary_dim channels of each query and key head turn on interleaved pairs (GPT-J style, as
 * glm_model.RotaryEmbedding.rotate) by the angles cos, sin [tokens, rotary_dim / 2]; then token t's keys and values
 * go to slot slots[t] of k_cache and v_cache ([slots, kv_heads, head_dim]). */
void rotary_store_kv_f32(float *qkv, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         int64_t rotary_dim, const float *cos, const float *sin, const int64_t *slots,
                         float *restrict k_cache, float *restrict v_cache, int num_threads)
{
    const int64_t width = (heads + 2 * kv_heads) * head_dim, pairs = rotary_dim / 2, kv_width = kv_heads * head_dim;
#pragma omp parallel for num_threads(num_threads) if (tokens * width >= PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < tokens; t++) {
        float *row = qkv + t * width;
        const float *c = cos + t * pairs, *s = sin + t * pairs;
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            float *x = row + h * head_dim;
            for (int64_t i = 0; i < pairs; i++) {
                const float even = x[2 * i], odd = x[2 * i + 1];
                x[2 * i] = even * c[i] - odd * s[i];
                x[2 * i + 1] = odd * c[i] + even * s[i];
            }
        }
        memcpy(k_cache + slots[t] * kv_width, row + heads * head_dim, sizeof(float) * kv_width);
        memcpy(v_cache + slots[t] * kv_width, row + heads * head_dim + kv_width, sizeof(float) * kv_width);
    }
}
