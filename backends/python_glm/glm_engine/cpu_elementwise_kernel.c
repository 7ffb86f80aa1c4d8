/* The element-wise work of a decoder layer on the CPU, one pass each: RMSNorm (with the residual addition before
 * it) and SiLU(gate) * up. In torch each is five or more operators, each its own pass over memory and its own
 * dispatch: microseconds apiece, which add up at decode sizes (docs/performance.md).
 *
 * Built and loaded by cpu_elementwise_kernel.py (compiled for the CPU it runs on: c_kernels.py). Float32; rows are
 * shared out between threads only when there are enough of them to pay for waking the threads.
 */

#include <math.h>
#include <stddef.h>
#include <stdint.h>

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
