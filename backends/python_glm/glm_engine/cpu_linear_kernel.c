/* Float32 linear layers on the CPU: out = x @ weight^T (+ bias), the weight packed once at load.
 *
 * Built and loaded by cpu_linear_kernel.py (compiled for the CPU it runs on: c_kernels.py). The weight [out, in] is
 * packed into panels of PANEL output channels: panel p holds, for every input channel j, the weights of outputs
 * p * PANEL .. p * PANEL + PANEL - 1 side by side ([in, PANEL] floats, zero-padded past the last output). A product
 * then reads each panel front to back, a stream the hardware prefetcher follows, which keeps the small products of
 * decode steps from waiting on memory the way oneDNN's do here.
 *
 * The micro-kernel: up to ROWS rows of x against one panel, VECS accumulator vectors a row (one per vector of the
 * panel), one broadcast of x a row and VECS loads of the panel per ROWS x VECS multiply-adds (GCC's vector
 * extension). The tile is as large as the vector registers that -march=native allows: with AVX-512 (32 registers
 * of 16 floats) 8 rows x 32 outputs, else (AVX2 and the rest: 16 registers of 8) 6 rows x 16 outputs.
 * Rows go in blocks of ROW_BLOCK so that a block of x stays in the cache while every panel passes; threads share the
 * panels of a block. Each output is one sum over the input channels in order, whatever the row count or the tile:
 * a token's result does not depend on the rest of the batch.
 */

#include <stdint.h>
#include <string.h>

#ifdef __AVX512F__
typedef float vec __attribute__((vector_size(64)));
#define PANEL 32
#define ROWS 8
#else
typedef float vec __attribute__((vector_size(32)));
#define PANEL 16
#define ROWS 6
#endif
#include "cpu_tiles.h"
#define LANES ((int)(sizeof(vec) / sizeof(float)))
#define VECS (PANEL / LANES)
#define ROW_BLOCK 96
/* How far ahead of the row it multiplies a tile asks for the panel (32 KiB): in decode steps the weights come from
 * memory, and the hardware prefetcher alone kept 20-30 GB/s of them coming where 35-55 do with this (bench in
 * docs/performance.md). Past the panel's end it asks for the next one, which the thread reads next. */
#define PREFETCH_ROWS (32768 / (PANEL * 4))

/* The panel width this build packs for (cpu_linear_kernel.py sizes the packed weight by it). */
int linear_f32_panel(void)
{
    return PANEL;
}

static inline vec load_vec(const float *p)
{
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* out[r, 0 .. width) = x[r, :] . panel (+ bias) for rows r < rows (<= ROWS), one panel. */
static inline __attribute__((always_inline)) void tile(float *out, int64_t out_stride, const float *x,
                                                       int64_t in_features, const float *panel, const float *bias,
                                                       int64_t width, int rows)
{
    vec acc[ROWS][VECS];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < VECS; v++)
            acc[r][v] = (vec){0};
    for (int64_t j = 0; j < in_features; j++) {
        vec w[VECS];
        for (int v = 0; v < VECS; v++)
            w[v] = load_vec(panel + j * PANEL + v * LANES);
        for (int c = 0; c < PANEL; c += 16) /* 16 floats: a 64-byte cache line */
            __builtin_prefetch(panel + (j + PREFETCH_ROWS) * PANEL + c, 0, 3);
        for (int r = 0; r < rows; r++) {
            const float xr = x[r * in_features + j];
            for (int v = 0; v < VECS; v++)
                acc[r][v] += xr * w[v];
        }
    }
    for (int r = 0; r < rows; r++) {
        float sums[PANEL];
        memcpy(sums, acc[r], sizeof sums);
        for (int64_t c = 0; c < width; c++)
            out[r * out_stride + c] = bias ? sums[c] + bias[c] : sums[c];
    }
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
    tile(out + r * out_features + first, out_features, x + r * in_features, in_features, panel, panel_bias, width, \
         COUNT)
                RUN_TILE(end_row - r) /* constant counts: unrolled tiles */
#undef TILE
            }
        }
    }
}
