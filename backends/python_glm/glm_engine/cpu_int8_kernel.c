/* INT8 linear layers on x86 CPUs: out = dequantize(quantize(x) @ weight^T) (+ bias), the weight packed once at load,
 * each token's activations quantized inside the call. Built and loaded by cpu_int8_kernel.py (compiled for the CPU
 * it runs on: c_kernels.py). Three builds, as the CPU allows:
 *
 * - AVX-512 VNNI (Ice Lake and later, AMD Zen 4 and later): vpdpbusd multiplies 4 uint8 by 4 int8 and adds them
 *   into an int32 in one instruction. Weights +-127 per output channel, activations +-127 per token shifted by 128
 *   into uint8 1 .. 255: the integers torch._int_mm would sum, without its separate quantizing and rescaling
 *   passes.
 * - AMX (Sapphire Rapids and later): the VNNI build's packing, quantizing and rescaling, with the sums made by tile
 *   instructions: tdpbusd multiplies a 16 x 64 tile of uint8 activations by a 64 x 16 tile of int8 weights into 16 x 16
 *   int32 sums, 16 VNNI instructions' work in one. The panel's layout is already the one a weight tile wants (4
 *   inputs of 16 outputs a 64-byte row, read with the panel's 128-byte stride); the input is padded to a multiple of
 *   64, a tile's depth. The sums are the same integers as the VNNI build's, so the outputs are the same bits.
 * - AVX2 without VNNI (e.g. AMD Zen 2): the only int8 product, vpmaddubsw, multiplies uint8 by int8 and adds each
 *   pair of products into a saturating int16; a second multiply, vpmaddwd by ones, widens pairs of those into int32.
 *   Both go to the same multiply unit, so one such step per 32 products is no faster than float32's multiply-adds.
 *   Here weights and activations keep to 7 bits (+-63; activations shifted by 64 into 1 .. 127): a pair of products
 *   is then at most 2 * 127 * 63 = 16002 and two pairs 32004 < 32767, so two steps' int16 sums add exactly before
 *   one widening: 1.5 multiply instructions per 32 products instead of 2, and a quarter of float32's weight bytes.
 *
 * In every build the shift adds SHIFT * (sum of the channel's weights) to each output, which the packed weight carries
 * (its compensation) and the kernel takes away; every integer sum is exact. The weight [out, in] is packed into
 * panels of PANEL output channels: for every 4 input channels, the panel holds the 4 weights of each of its outputs
 * side by side (one int32 lane an output), the input zero-padded to a multiple of GROUP. The micro-kernel takes up
 * to ROWS tokens (AMX: AMX_ROWS) against one panel. Each output's sum is the same integers whatever the batch, then
 * scaled by the token's and the channel's scales: a token's result does not depend on the rest of the batch.
 */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PANEL 32
#define ROWS 8
#define VALUE_MAX 127 /* weights and activations */
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define AMX 1
#include <errno.h>
#include <sys/syscall.h>
#include <unistd.h>
#define GROUP 64 /* a tile's depth: 64 inputs */
#endif
#elif defined(__AVX2__)
#define PANEL 16
#define ROWS 6
#define VALUE_MAX 63
#else
#error "the int8 kernel needs AVX2 (compiled with -march=native on a CPU without it)"
#endif
#include "cpu_prefetch.h"
#include "cpu_tiles.h"
#define SHIFT (VALUE_MAX + 1)
#ifndef GROUP
#define GROUP 8 /* the packed input's padding: two steps of 4 on AVX2 */
#endif
#define ROW_BLOCK 96
/* How far ahead of the inputs it multiplies a tile asks for the panel, as in cpu_linear_kernel.c. */
#define PREFETCH_BYTES 32768
#define MIN_SCALE 1e-12f /* as quantization.MIN_SCALE: a row of zeros still divides by something */

/* What this build takes (cpu_int8_kernel.py sizes and quantizes the weight by them). */
int linear_i8_panel(void)
{
    return PANEL;
}

int linear_i8_value_max(void)
{
    return VALUE_MAX;
}

int linear_i8_group(void)
{
    return GROUP;
}

/* 0, or the errno of Linux's refusal to let this process use AMX tiles (each process must ask, Linux 5.16 and up):
 * the caller then builds without AMX. */
int linear_i8_init(void)
{
#ifdef AMX
    enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : errno;
#else
    return 0;
#endif
}

/* packed: [ceil(out / PANEL), padded_in / 4, PANEL, 4] int8 from weight [out, in] (+-VALUE_MAX, contiguous);
 * compensation[o] = SHIFT * sum of weight row o. */
void pack_linear_weight_i8(int8_t *packed, int32_t *compensation, const int8_t *weight, int64_t out_features,
                           int64_t in_features, int64_t padded_in)
{
    const int64_t panels = (out_features + PANEL - 1) / PANEL;
    memset(packed, 0, (size_t)(panels * padded_in * PANEL));
    for (int64_t o = 0; o < out_features; o++) {
        int32_t sum = 0;
        for (int64_t j = 0; j < in_features; j++) {
            const int8_t w = weight[o * in_features + j];
            packed[((o / PANEL * (padded_in / 4) + j / 4) * PANEL + o % PANEL) * 4 + j % 4] = w;
            sum += w;
        }
        compensation[o] = SHIFT * sum;
    }
}

/* One token's activations: scale = max|x| / VALUE_MAX and x / scale rounded (to even, as torch.round), shifted to
 * uint8. The padding gets the shift (a zero activation): it meets zero weights anyway. */
static void quantize_row(uint8_t *values, float *scale, const float *x, int64_t in_features, int64_t padded_in)
{
    float largest = 0.0f;
    for (int64_t j = 0; j < in_features; j++)
        largest = fmaxf(largest, fabsf(x[j]));
    const float s = fmaxf(largest, MIN_SCALE) / VALUE_MAX;
    for (int64_t j = 0; j < in_features; j++)
        values[j] = (uint8_t)((int)nearbyintf(x[j] / s) + SHIFT);
    memset(values + in_features, SHIFT, (size_t)(padded_in - in_features));
    *scale = s;
}

static inline int32_t four_bytes(const uint8_t *p)
{
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

#if VALUE_MAX == 127
/* What rescales a panel's sums, loaded once a tile: per half of the panel's 32 outputs, the lanes within its width,
 * the compensation, the weight scales and the bias (0 without one). */
struct rescale {
    __mmask16 lanes[2];
    __m512i shift[2];
    __m512 scale[2], add[2];
};

static inline __attribute__((always_inline)) struct rescale load_rescale(const int32_t *compensation,
                                                                         const float *weight_scale, const float *bias,
                                                                         int64_t width)
{
    struct rescale r;
    for (int half = 0; half < 2; half++) {
        const int64_t left = width - 16 * half;
        const __mmask16 lanes = left >= 16 ? 0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
        r.lanes[half] = lanes;
        r.shift[half] = _mm512_maskz_loadu_epi32(lanes, compensation + 16 * half);
        r.scale[half] = _mm512_maskz_loadu_ps(lanes, weight_scale + 16 * half);
        r.add[half] = bias ? _mm512_maskz_loadu_ps(lanes, bias + 16 * half) : _mm512_setzero_ps();
    }
    return r;
}

/* One token's outputs of a panel from its two vectors of 16 sums: (sum - compensation) * (weight scale * token
 * scale) (+ bias), in intrinsics that -ffast-math cannot reorder: every tile size and build computes a token's
 * outputs the same way, whatever the batch. */
static inline __attribute__((always_inline)) void store_token(float *out, const __m512i sums[2], float token_scale,
                                                              const struct rescale *r)
{
    for (int half = 0; half < 2; half++) {
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums[half], r->shift[half]));
        const __m512 value = _mm512_fmadd_ps(sum, _mm512_mul_ps(r->scale[half], _mm512_set1_ps(token_scale)),
                                             r->add[half]);
        _mm512_mask_storeu_ps(out + 16 * half, r->lanes[half], value);
    }
}

/* out[r, 0 .. width) for tokens r < rows (<= ROWS) against one panel: two int32 vectors of 16 outputs a token. */
static inline __attribute__((always_inline)) void tile(float *out, int64_t out_stride, const uint8_t *values,
                                                       int64_t padded_in, const float *token_scales,
                                                       const int8_t *panel, const int32_t *compensation,
                                                       const float *weight_scale, const float *bias,
                                                       int64_t width, int rows)
{
    /* A token's two sums in variables of their own, not an array: GCC 12 then keeps them in registers, where with
     * an array it copied every sum between registers and the stack at each step (half the speed). */
    const __m512i zero = _mm512_setzero_si512();
    __m512i lo0 = zero, hi0 = zero, lo1 = zero, hi1 = zero, lo2 = zero, hi2 = zero, lo3 = zero, hi3 = zero;
    __m512i lo4 = zero, hi4 = zero, lo5 = zero, hi5 = zero, lo6 = zero, hi6 = zero, lo7 = zero, hi7 = zero;
    for (int64_t j = 0; j < padded_in; j += 4) {
        const int8_t *w = panel + j * PANEL; /* [PANEL, 4] */
        const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
        PREFETCH_TO_L2(w + PREFETCH_BYTES);
        PREFETCH_TO_L2(w + PREFETCH_BYTES + 64);
#define STEP(r)                                                                         \
    if (r < rows) {                                                                     \
        const __m512i x = _mm512_set1_epi32(four_bytes(values + r * padded_in + j));   \
        lo##r = _mm512_dpbusd_epi32(lo##r, x, w0);                                      \
        hi##r = _mm512_dpbusd_epi32(hi##r, x, w1);                                      \
    }
        STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5) STEP(6) STEP(7)
#undef STEP
    }
    const __m512i acc[ROWS][2] = {{lo0, hi0}, {lo1, hi1}, {lo2, hi2}, {lo3, hi3},
                                  {lo4, hi4}, {lo5, hi5}, {lo6, hi6}, {lo7, hi7}};
    const struct rescale rescale = load_rescale(compensation, weight_scale, bias, width);
    for (int r = 0; r < rows; r++)
        store_token(out + r * out_stride, acc[r], token_scales[r], &rescale);
}
#else
/* out[r, 0 .. width) for tokens r < rows (<= ROWS) against one panel: two int32 vectors of 8 outputs a token. */
static inline __attribute__((always_inline)) void tile(float *out, int64_t out_stride, const uint8_t *values,
                                                       int64_t padded_in, const float *token_scales,
                                                       const int8_t *panel, const int32_t *compensation,
                                                       const float *weight_scale, const float *bias,
                                                       int64_t width, int rows)
{
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[ROWS][2];
    for (int r = 0; r < rows; r++)
        acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int64_t j = 0; j < padded_in; j += GROUP) {
        const int8_t *w = panel + j * PANEL; /* [2, PANEL, 4]: inputs j .. j + 3, then j + 4 .. j + 7 */
        const __m256i a0 = _mm256_loadu_si256((const __m256i *)w), a1 = _mm256_loadu_si256((const __m256i *)(w + 32));
        const __m256i b0 = _mm256_loadu_si256((const __m256i *)(w + 64));
        const __m256i b1 = _mm256_loadu_si256((const __m256i *)(w + 96));
        PREFETCH_TO_L2(w + PREFETCH_BYTES);
        PREFETCH_TO_L2(w + PREFETCH_BYTES + 64);
        for (int r = 0; r < rows; r++) {
            const __m256i x = _mm256_set1_epi32(four_bytes(values + r * padded_in + j));
            const __m256i y = _mm256_set1_epi32(four_bytes(values + r * padded_in + j + 4));
            const __m256i s0 = _mm256_add_epi16(_mm256_maddubs_epi16(x, a0), _mm256_maddubs_epi16(y, b0));
            const __m256i s1 = _mm256_add_epi16(_mm256_maddubs_epi16(x, a1), _mm256_maddubs_epi16(y, b1));
            acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(s0, ones));
            acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(s1, ones));
        }
    }
    /* As the VNNI build's: intrinsics -ffast-math cannot reorder, through zero-padded copies past the width. */
    for (int half = 0; half < 2 && width > 8 * half; half++) {
        const int64_t count = width - 8 * half < 8 ? width - 8 * half : 8;
        int32_t shifts[8] = {0};
        float scales[8] = {0}, adds[8] = {0}, values[8];
        memcpy(shifts, compensation + 8 * half, sizeof(int32_t) * count);
        memcpy(scales, weight_scale + 8 * half, sizeof(float) * count);
        if (bias)
            memcpy(adds, bias + 8 * half, sizeof(float) * count);
        const __m256i shift = _mm256_loadu_si256((const __m256i *)shifts);
        const __m256 scale = _mm256_loadu_ps(scales), add = _mm256_loadu_ps(adds);
        for (int r = 0; r < rows; r++) {
            const __m256 sum = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r][half], shift));
            _mm256_storeu_ps(values, _mm256_fmadd_ps(sum, _mm256_mul_ps(scale, _mm256_set1_ps(token_scales[r])), add));
            memcpy(out + r * out_stride + 8 * half, values, sizeof(float) * count);
        }
    }
}
#endif

#ifndef AMX
/* Each token count's tile a function of its own, never inlined into the loops below: GCC 12 keeps the sums in
 * registers only then (inlined, it copied them between registers at each step: half the speed). */
#define DEFINE_TILE(COUNT)                                                                                          \
    static __attribute__((noinline)) void tile_##COUNT(                                                            \
        float *out, int64_t out_stride, const uint8_t *values, int64_t padded_in, const float *token_scales,       \
        const int8_t *panel, const int32_t *compensation, const float *weight_scale, const float *bias,            \
        int64_t width)                                                                                             \
    {                                                                                                              \
        tile(out, out_stride, values, padded_in, token_scales, panel, compensation, weight_scale, bias, width,     \
             COUNT);                                                                                               \
    }
DEFINE_TILE(1) DEFINE_TILE(2) DEFINE_TILE(3) DEFINE_TILE(4) DEFINE_TILE(5) DEFINE_TILE(6)
#if ROWS == 8
DEFINE_TILE(7) DEFINE_TILE(8)
#endif
#undef DEFINE_TILE
#else
#define AMX_ROWS 32 /* tokens a tile step: two 16-token activation tiles */

/* Tiles 0-3: the sums of tokens 0-15 | 16-31 for outputs 0-15 | 16-31; 4, 5: those tokens' activations; 6, 7: the
 * two halves' weights. A configuration holds each tile's row count, so it is made for a number of tokens (1 .. 32);
 * the second token tile is left unconfigured below 17. */
static void configure_tiles(int tokens)
{
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t bytes_per_row[16];
        uint8_t rows[16];
    } config = {.palette = 1};
    const int first = tokens < 16 ? tokens : 16, second = tokens - first;
    const int rows[8] = {first, first, second, second, first, second, 16, 16};
    for (int t = 0; t < 8; t++) {
        config.rows[t] = (uint8_t)rows[t];
        config.bytes_per_row[t] = rows[t] ? 64 : 0;
    }
    _tile_loadconfig(&config);
}

/* As tile(), for the `tokens` the tiles are configured for. */
static void amx_tile(float *out, int64_t out_stride, const uint8_t *values, int64_t padded_in,
                     const float *token_scales, const int8_t *panel, const int32_t *compensation,
                     const float *weight_scale, const float *bias, int64_t width, int tokens)
{
    const int two = tokens > 16;
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t j = 0; j < padded_in; j += GROUP) {
        _tile_loadd(4, values + j, padded_in);
        _tile_loadd(6, panel + j * PANEL, PANEL * 4);
        _tile_loadd(7, panel + j * PANEL + 64, PANEL * 4);
        _tile_dpbusd(0, 4, 6);
        _tile_dpbusd(1, 4, 7);
        if (two) {
            _tile_loadd(5, values + 16 * padded_in + j, padded_in);
            _tile_dpbusd(2, 5, 6);
            _tile_dpbusd(3, 5, 7);
        }
    }
    int32_t sums[AMX_ROWS][PANEL];
    _tile_stored(0, sums[0], PANEL * 4);
    _tile_stored(1, sums[0] + 16, PANEL * 4);
    if (two) {
        _tile_stored(2, sums[16], PANEL * 4);
        _tile_stored(3, sums[16] + 16, PANEL * 4);
    }
    const struct rescale rescale = load_rescale(compensation, weight_scale, bias, width);
    for (int r = 0; r < tokens; r++) {
        const __m512i token_sums[2] = {_mm512_loadu_si512(sums[r]), _mm512_loadu_si512(sums[r] + 16)};
        store_token(out + r * out_stride, token_sums, token_scales[r], &rescale);
    }
}
#endif

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
#ifdef AMX
        /* This thread's share of the panels, each token block against all of it: the tile configuration then
         * changes at most once a call (for the last, shorter block), not at every panel. */
        const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t first_panel = panels * me / threads, end_panel = panels * (me + 1) / threads;
        int configured = 0;
        for (int64_t r = 0; r < rows && first_panel < end_panel; r += AMX_ROWS) {
            const int tokens = rows - r < AMX_ROWS ? (int)(rows - r) : AMX_ROWS;
            if (tokens != configured)
                configure_tiles(configured = tokens);
            for (int64_t p = first_panel; p < end_panel; p++) {
                const int64_t first = p * PANEL, width = out_features - first < PANEL ? out_features - first : PANEL;
                amx_tile(out + r * out_features + first, out_features, values + r * padded_in, padded_in,
                         token_scales + r, packed + p * padded_in * PANEL, compensation + first, weight_scale + first,
                         bias ? bias + first : NULL, width, tokens);
            }
        }
        if (configured)
            _tile_release();
#else
        for (int64_t first_row = 0; first_row < rows; first_row += ROW_BLOCK) {
            const int64_t end_row = rows - first_row < ROW_BLOCK ? rows : first_row + ROW_BLOCK;
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++) {
                const int64_t first = p * PANEL, width = out_features - first < PANEL ? out_features - first : PANEL;
                const int8_t *panel = packed + p * padded_in * PANEL;
                const float *panel_bias = bias ? bias + first : NULL;
                for (int64_t r = first_row; r < end_row; r += ROWS) {
#define TILE(COUNT)                                                                                                  \
    tile_##COUNT(out + r * out_features + first, out_features, values + r * padded_in, padded_in, token_scales + r, \
                 panel, compensation + first, weight_scale + first, panel_bias, width)
                    RUN_TILE(end_row - r)
#undef TILE
                }
            }
        }
#endif
    }
}
