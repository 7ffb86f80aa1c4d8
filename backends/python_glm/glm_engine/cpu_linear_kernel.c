/* Float32 linear layers on the CPU: out = x @ weight^T (+ bias), the weight packed once at load.
 *
 * Built and loaded by cpu_linear_kernel.py (compiled for the CPU it runs on: c_kernels.py). The weight [out, in] is
 * packed into panels of PANEL output channels: panel p holds, for every input channel j, the weights of outputs
 * p * PANEL .. p * PANEL + PANEL - 1 side by side ([in, PANEL] floats, zero-padded past the last output). A product
 * then reads each panel front to back, a stream the hardware prefetcher follows, which keeps the small products of
 * decode steps from waiting on memory the way oneDNN's do here.
 *
 * The micro-kernel: up to six rows of x against one panel, twelve accumulators of eight floats (6 rows x 16
 * outputs), one broadcast of x and two loads of the panel per six pairs of multiply-adds (GCC's vector extension:
 * AVX2 or AVX-512 on x86, NEON on Arm, as -march=native allows). Rows go in blocks of ROW_BLOCK so that a block of x
 * stays in the cache while every panel passes; threads share the panels of a block. Each output is one sum over the
 * input channels in order, whatever the row count: a token's result does not depend on the rest of the batch.
 */

#include <stdint.h>
#include <string.h>

#define PANEL 16
#define ROW_BLOCK 96

typedef float vec8 __attribute__((vector_size(32)));

static inline vec8 load8(const float *p)
{
    vec8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* out[r, 0 .. width) = x[r, :] . panel (+ bias) for rows r < ROWS, one panel. */
#define DEFINE_TILE(ROWS)                                                                                          \
    static void tile_##ROWS(float *out, int64_t out_stride, const float *x, int64_t x_stride, const float *panel, \
                            int64_t in_features, const float *bias, int64_t width)                                 \
    {                                                                                                              \
        vec8 acc[ROWS][2];                                                                                         \
        for (int r = 0; r < ROWS; r++)                                                                             \
            acc[r][0] = acc[r][1] = (vec8){0};                                                                     \
        for (int64_t j = 0; j < in_features; j++) {                                                                \
            const vec8 w0 = load8(panel + j * PANEL), w1 = load8(panel + j * PANEL + 8);                           \
            for (int r = 0; r < ROWS; r++) {                                                                       \
                const float xr = x[r * x_stride + j];                                                              \
                acc[r][0] += xr * w0;                                                                              \
                acc[r][1] += xr * w1;                                                                              \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < ROWS; r++) {                                                                           \
            float sums[PANEL];                                                                                     \
            memcpy(sums, &acc[r][0], sizeof acc[r][0]);                                                            \
            memcpy(sums + 8, &acc[r][1], sizeof acc[r][1]);                                                        \
            for (int64_t c = 0; c < width; c++)                                                                    \
                out[r * out_stride + c] = bias ? sums[c] + bias[c] : sums[c];                                      \
        }                                                                                                          \
    }

DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(3)
DEFINE_TILE(4)
DEFINE_TILE(5)
DEFINE_TILE(6)

/* packed: [ceil(out / PANEL), in, PANEL] (see above) from weight: [out, in], contiguous. */
void pack_linear_weight_f32(float *packed, const float *weight, int64_t out_features, int64_t in_features)
{
    const int64_t panels = (out_features + PANEL - 1) / PANEL;
    memset(packed, 0, sizeof(float) * panels * in_features * PANEL);
    for (int64_t o = 0; o < out_features; o++)
        for (int64_t j = 0; j < in_features; j++)
            packed[(o / PANEL * in_features + j) * PANEL + o % PANEL] = weight[o * in_features + j];
}

/* out: [rows, out_features], contiguous; x: [rows, in_features], contiguous; bias: [out_features] or NULL. */
void linear_f32(float *out, const float *x, int64_t rows, const float *packed, const float *bias,
                int64_t out_features, int64_t in_features, int num_threads)
{
    const int64_t panels = (out_features + PANEL - 1) / PANEL;
#pragma omp parallel num_threads(num_threads)
    for (int64_t first_row = 0; first_row < rows; first_row += ROW_BLOCK) {
        const int64_t end_row = rows - first_row < ROW_BLOCK ? rows : first_row + ROW_BLOCK;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const float *panel = packed + p * in_features * PANEL;
            const float *panel_bias = bias ? bias + p * PANEL : NULL;
            const int64_t first = p * PANEL, width = out_features - first < PANEL ? out_features - first : PANEL;
            int64_t r = first_row;
            for (; r + 6 <= end_row; r += 6)
                tile_6(out + r * out_features + first, out_features, x + r * in_features, in_features, panel,
                       in_features, panel_bias, width);
            float *o = out + r * out_features + first;
            const float *xr = x + r * in_features;
            switch (end_row - r) {
            case 1: tile_1(o, out_features, xr, in_features, panel, in_features, panel_bias, width); break;
            case 2: tile_2(o, out_features, xr, in_features, panel, in_features, panel_bias, width); break;
            case 3: tile_3(o, out_features, xr, in_features, panel, in_features, panel_bias, width); break;
            case 4: tile_4(o, out_features, xr, in_features, panel, in_features, panel_bias, width); break;
            case 5: tile_5(o, out_features, xr, in_features, panel, in_features, panel_bias, width); break;
            }
        }
    }
}
