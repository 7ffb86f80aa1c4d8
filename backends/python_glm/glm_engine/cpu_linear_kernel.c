/* Float32 linear layers on the CPU: out = x @ weight^T (+ bias), the weight packed once at load.
 *
 * Built and loaded by cpu_linear_kernel.py (compiled for the CPU it runs on: c_kernels.py). The weight [out, in] is
 * packed into panels of PANEL output channels: panel p holds, for every input channel j, the weights of outputs
 * p * PANEL .. p * PANEL + PANEL - 1 side by side ([in, PANEL] floats, zero-padded past the last output). A product
 * then reads each panel front to back, a stream the hardware prefetcher follows, which keeps the small products of
 * decode steps from waiting on memory the way oneDNN's do here.
 *
 * The micro-kernel (cpu_f32_tile.h): up to ROWS rows of x against one panel, 8 x 32 with AVX-512, else 6 x 16.
 * Rows go in blocks of ROW_BLOCK so that a block of x stays in the cache while every panel passes; threads share the
 * panels of a block. Each output is one sum over the input channels in order, whatever the row count or the tile:
 * a token's result does not depend on the rest of the batch.
 */

#include "cpu_f32_tile.h"
#define ROW_BLOCK 96

/* The panel width this build packs for (cpu_linear_kernel.py sizes the packed weight by it). */
int linear_f32_panel(void)
{
    return PANEL;
}

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
            for (int64_t r = first_row; r < end_row; r += ROWS) {
#define TILE(COUNT)                                                                                                  \
    tile(out + r * out_features + first, out_features, x + r * in_features, in_features, in_features, panel,       \
         panel_bias, width, COUNT)
                RUN_TILE(end_row - r) /* constant counts: unrolled tiles */
#undef TILE
            }
        }
    }
}
