/* INT8 linear layers on x86 CPUs with AVX2 but no int8 dot-product instruction (no VNNI: e.g. AMD Zen 2):
 * out = dequantize(quantize(x) @ weight^T) (+ bias), the weight packed once at load.
 *
 * Built and loaded by cpu_int8_kernel.py (compiled for the CPU it runs on: c_kernels.py; without AVX2 it does not
 * build). AVX2's only int8 product, vpmaddubsw, multiplies uint8 by int8 and adds each pair of products into a
 * saturating int16; a second multiply, vpmaddwd by ones, widens pairs of those into int32. Both go to the same
 * multiply unit, so one such step per 32 products is no faster than float32's fused multiply-adds. Here values
 * are kept small enough that two steps' int16 sums add without overflow before they are widened: 1.5 multiply
 * instructions per 32 products instead of 2, and a quarter of float32's weight bytes to read.
 *
 * The values: each token's activations are quantized to +-63 (7 bits) and shifted by 64 into 1 .. 127 (uint8);
 * each weight row (output channel) to +-63. A pair of products is then at most 2 * 127 * 63 = 16002 and two pairs
 * 32004 < 32767: every integer sum is exact. The shift adds 64 * (sum of the channel's weights) to each output, which
 * the packed weight carries (its compensation) and the kernel takes away.
 *
 * The weight [out, in] is packed into panels of PANEL output channels: for every GROUP input channels, the panel
 * holds 4 consecutive weights of each of its 16 outputs side by side (vpmaddubsw's layout: one int32 lane an output),
 * the input zero-padded to a multiple of GROUP. The micro-kernel takes ROWS tokens against one panel, two int32
 * accumulators of 8 outputs a token. Each output's sum is the same integers in the same order whatever the batch,
 * then scaled by the token's and the channel's scales: a token's result does not depend on the rest of the batch.
 */

#ifndef __AVX2__
#error "the int8 kernel needs AVX2 (compiled with -march=native on a CPU without it)"
#endif

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PANEL 16
#define GROUP 8 /* input channels a step: two vpmaddubsw of 4 */
#define ROWS 6
#define ROW_BLOCK 96
#define ACTIVATION_MAX 63.0f
#define ACTIVATION_SHIFT 64
#define MIN_SCALE 1e-12f /* as quantization.MIN_SCALE: a row of zeros still divides by something */

/* packed: [ceil(out / PANEL), padded_in / GROUP, 2, PANEL, 4] int8 from weight [out, in] (+-63, contiguous);
 * compensation[o] = ACTIVATION_SHIFT * sum of weight row o. */
void pack_linear_weight_i8(int8_t *packed, int32_t *compensation, const int8_t *weight, int64_t out_features,
                           int64_t in_features, int64_t padded_in)
{
    const int64_t panels = (out_features + PANEL - 1) / PANEL;
    memset(packed, 0, (size_t)(panels * padded_in * PANEL));
    for (int64_t o = 0; o < out_features; o++) {
        int32_t sum = 0;
        for (int64_t j = 0; j < in_features; j++) {
            const int64_t quad = j / 4; /* 4 inputs of one output lie together */
            packed[((o / PANEL * (padded_in / 4) + quad) * PANEL + o % PANEL) * 4 + j % 4] = weight[o * in_features + j];
            sum += weight[o * in_features + j];
        }
        compensation[o] = ACTIVATION_SHIFT * sum;
    }
}

/* One token's activations: scale = max|x| / 63 and x / scale rounded (to even, as torch.round), shifted to uint8.
 * The padding gets the shift (a zero activation): it meets zero weights anyway. */
static void quantize_row(uint8_t *values, float *scale, const float *x, int64_t in_features, int64_t padded_in)
{
    float largest = 0.0f;
    for (int64_t j = 0; j < in_features; j++)
        largest = fmaxf(largest, fabsf(x[j]));
    const float s = fmaxf(largest, MIN_SCALE) / ACTIVATION_MAX;
    for (int64_t j = 0; j < in_features; j++)
        values[j] = (uint8_t)((int)nearbyintf(x[j] / s) + ACTIVATION_SHIFT);
    memset(values + in_features, ACTIVATION_SHIFT, (size_t)(padded_in - in_features));
    *scale = s;
}

static inline __m256i broadcast4(const uint8_t *p)
{
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

/* out[r, 0 .. width) for tokens r < rows (<= ROWS) against one panel. */
static inline __attribute__((always_inline)) void tile(float *out, int64_t out_stride, const uint8_t *values,
                                                       int64_t padded_in, const float *token_scales,
                                                       const int8_t *panel, const int32_t *compensation,
                                                       const float *weight_scale, const float *bias,
                                                       int64_t width, int rows)
{
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[ROWS][2];
    for (int r = 0; r < ROWS; r++)
        acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int64_t j = 0; j < padded_in; j += GROUP) {
        const int8_t *w = panel + j * PANEL; /* [2, PANEL, 4] */
        const __m256i a0 = _mm256_loadu_si256((const __m256i *)w), a1 = _mm256_loadu_si256((const __m256i *)(w + 32));
        const __m256i b0 = _mm256_loadu_si256((const __m256i *)(w + 64));
        const __m256i b1 = _mm256_loadu_si256((const __m256i *)(w + 96));
        for (int r = 0; r < rows; r++) {
            const __m256i x = broadcast4(values + r * padded_in + j), y = broadcast4(values + r * padded_in + j + 4);
            const __m256i s0 = _mm256_add_epi16(_mm256_maddubs_epi16(x, a0), _mm256_maddubs_epi16(y, b0));
            const __m256i s1 = _mm256_add_epi16(_mm256_maddubs_epi16(x, a1), _mm256_maddubs_epi16(y, b1));
            acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(s0, ones));
            acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(s1, ones));
        }
    }
    for (int r = 0; r < rows; r++) {
        int32_t sums[PANEL];
        memcpy(sums, &acc[r][0], sizeof acc[r][0]);
        memcpy(sums + 8, &acc[r][1], sizeof acc[r][1]);
        for (int64_t c = 0; c < width; c++) {
            const float value = (float)(sums[c] - compensation[c]) * token_scales[r] * weight_scale[c];
            out[r * out_stride + c] = bias ? value + bias[c] : value;
        }
    }
}

/* out: [rows, out_features] float32; x: [rows, in_features] float32, contiguous; values, token_scales: scratch
 * [rows, padded_in] uint8 and [rows] float32 (left holding x quantized, for tests); weight_scale [out_features];
 * bias [out_features] or NULL. */
void linear_i8(float *out, const float *x, int64_t rows, const int8_t *packed, const int32_t *compensation,
               const float *weight_scale, const float *bias, int64_t out_features, int64_t in_features,
               int64_t padded_in, uint8_t *values, float *token_scales, int num_threads)
{
    const int64_t panels = (out_features + PANEL - 1) / PANEL;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            quantize_row(values + r * padded_in, token_scales + r, x + r * in_features, in_features, padded_in);
        for (int64_t first_row = 0; first_row < rows; first_row += ROW_BLOCK) {
            const int64_t end_row = rows - first_row < ROW_BLOCK ? rows : first_row + ROW_BLOCK;
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++) {
                const int64_t first = p * PANEL, width = out_features - first < PANEL ? out_features - first : PANEL;
                const int8_t *panel = packed + p * padded_in * PANEL;
                const float *panel_bias = bias ? bias + first : NULL;
                for (int64_t r = first_row; r < end_row; r += ROWS) {
#define TILE(COUNT)                                                                                                  \
    tile(out + r * out_features + first, out_features, values + r * padded_in, padded_in, token_scales + r, panel, \
         compensation + first, weight_scale + first, panel_bias, width, COUNT)
                    switch (end_row - r < ROWS ? end_row - r : ROWS) { /* constant counts: unrolled tiles */
                    case 6: TILE(6); break;
                    case 5: TILE(5); break;
                    case 4: TILE(4); break;
                    case 3: TILE(3); break;
                    case 2: TILE(2); break;
                    case 1: TILE(1); break;
                    }
#undef TILE
                }
            }
        }
    }
}
