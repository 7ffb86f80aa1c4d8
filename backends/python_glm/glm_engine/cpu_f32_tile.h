/* The float32 micro-kernel the C kernels share (cpu_linear_kernel.c, cpu_prefill_kernel.c): up to ROWS rows of x
 * against one panel of PANEL columns, packed [in, PANEL] (column c of input j at j * PANEL + c). VECS accumulator
 * vectors a row (one per vector of the panel), one broadcast of x a row and VECS loads of the panel per ROWS x VECS
 * multiply-adds (GCC's vector extension). The tile is as large as the vector registers that -march=native allows:
 * with AVX-512 (32 registers of 16 floats) 8 rows x 32 columns, else (AVX2 and the rest: 16 registers of 8) 6 rows
 * x 16 columns. Each output is one sum over the inputs in order, whatever the row count: a row's result does not
 * depend on the rows beside it. The includer calls tile() through RUN_TILE (cpu_tiles.h). */

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
#include "cpu_prefetch.h"
#include "cpu_tiles.h"
#define LANES ((int)(sizeof(vec) / sizeof(float)))
#define VECS (PANEL / LANES)
/* How far ahead of the input it multiplies a tile asks for the panel (32 KiB): in decode steps the weights come
 * from memory, where the hardware prefetcher alone left the linear kernel waiting (docs/performance.md). Past the
 * panel's end it asks for the next one, which the linear kernel's thread reads next. */
#define PREFETCH_ROWS (32768 / (PANEL * 4))

static inline vec load_vec(const float *p)
{
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* out[r, 0 .. width) = x[r, 0 .. in_features) . panel (+ bias) for rows r < rows (<= ROWS), x's rows x_stride
 * apart. */
static inline __attribute__((always_inline)) void tile(float *out, int64_t out_stride, const float *x,
                                                       int64_t x_stride, int64_t in_features, const float *panel,
                                                       const float *bias, int64_t width, int rows)
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
            PREFETCH_TO_L2(panel + (j + PREFETCH_ROWS) * PANEL + c);
        for (int r = 0; r < rows; r++) {
            const float xr = x[r * x_stride + j];
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
