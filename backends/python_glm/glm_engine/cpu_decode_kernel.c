/* Paged-attention decode on the CPU: one query token per sequence, keys and values read from their KV blocks in
 * place (the torch path first copies every sequence's blocks into one padded tensor, then runs SDPA over it).
 *
 * Built and loaded by cpu_decode_kernel.py: compiled with -ffast-math (so that expf vectorizes), linked without it
 * (a shared object linked with it would switch the whole process to flush-to-zero). No torch headers: plain C and
 * OpenMP, whose runtime is the one torch has already loaded.
 *
 * Work items are sequences (or, with few sequences, (sequence, KV head) pairs), shared out between threads. For
 * each KV head of an item, its query heads' scores against every key of the context, an exact softmax over them,
 * then the weighted sum of the values: keys read once, values read once, whatever the group size. Nothing depends
 * on the other sequences of the batch, so a sequence's output is the same whatever it is batched with.
 *
 * Eight floats at a time through GCC's vector extension (AVX2 or AVX-512 on x86, NEON on Arm, as -march=native
 * allows), four query heads and two keys at a time, so that the products run in independent sums.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_prefetch.h"

typedef float vec8 __attribute__((vector_size(32)));

static inline vec8 load8(const float *p)
{
    vec8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, vec8 v)
{
    memcpy(p, &v, sizeof v);
}

static inline float sum8(vec8 v)
{
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* scores[g * len] = q_g . k * scale for the group's query heads. */
static void score_token(float *scores, int64_t len, const float *q, int64_t q_head_stride, const float *k,
                        int64_t group, int64_t head_dim, float scale)
{
    const int64_t vector_dims = head_dim & ~(int64_t)7;
    int64_t g = 0;
    for (; g + 4 <= group; g += 4) {
        const float *q0 = q + g * q_head_stride, *q1 = q0 + q_head_stride, *q2 = q1 + q_head_stride,
                    *q3 = q2 + q_head_stride;
        vec8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t d = 0; d < vector_dims; d += 8) {
            const vec8 kv = load8(k + d);
            a0 += load8(q0 + d) * kv;
            a1 += load8(q1 + d) * kv;
            a2 += load8(q2 + d) * kv;
            a3 += load8(q3 + d) * kv;
        }
        float s0 = sum8(a0), s1 = sum8(a1), s2 = sum8(a2), s3 = sum8(a3);
        for (int64_t d = vector_dims; d < head_dim; d++) {
            s0 += q0[d] * k[d];
            s1 += q1[d] * k[d];
            s2 += q2[d] * k[d];
            s3 += q3[d] * k[d];
        }
        scores[g * len] = s0 * scale;
        scores[(g + 1) * len] = s1 * scale;
        scores[(g + 2) * len] = s2 * scale;
        scores[(g + 3) * len] = s3 * scale;
    }
    for (; g < group; g++) {
        const float *qg = q + g * q_head_stride;
        float dot = 0.0f;
        for (int64_t d = 0; d < head_dim; d++)
            dot += qg[d] * k[d];
        scores[g * len] = dot * scale;
    }
}

/* acc[g] += sum over the block's slots of p[g * len + s] * v_s, for the group's query heads: eight dimensions at a
 * time across all the block's slots, so that the sums stay in registers while the block stays in L1. */
static void add_block_values(float *acc, const float *p, int64_t len, const float *v, int64_t slot_stride,
                             int64_t slots, int64_t group, int64_t head_dim)
{
    const int64_t vector_dims = head_dim & ~(int64_t)7;
    int64_t g = 0;
    for (; g + 4 <= group; g += 4) {
        const float *p0 = p + g * len, *p1 = p0 + len, *p2 = p1 + len, *p3 = p2 + len;
        for (int64_t d = 0; d < vector_dims; d += 8) {
            vec8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t s = 0; s < slots; s++) {
                const vec8 vv = load8(v + s * slot_stride + d);
                a0 += p0[s] * vv;
                a1 += p1[s] * vv;
                a2 += p2[s] * vv;
                a3 += p3[s] * vv;
            }
            float *out = acc + g * head_dim + d;
            store8(out, load8(out) + a0);
            store8(out + head_dim, load8(out + head_dim) + a1);
            store8(out + 2 * head_dim, load8(out + 2 * head_dim) + a2);
            store8(out + 3 * head_dim, load8(out + 3 * head_dim) + a3);
        }
    }
    /* The heads left over, and the dimensions past the last multiple of eight of the others. */
    for (int64_t h = 0; h < group; h++)
        for (int64_t s = 0; s < slots; s++)
            for (int64_t d = h < g ? vector_dims : 0; d < head_dim; d++)
                acc[h * head_dim + d] += p[h * len + s] * v[s * slot_stride + d];
}

typedef int32_t ivec8 __attribute__((vector_size(32)));

/* Adjacent pairs of a and b summed, within each half: [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7]. */
static inline vec8 pair_sums(vec8 a, vec8 b)
{
    const ivec8 even = {0, 2, 8, 10, 4, 6, 12, 14}, odd = {1, 3, 9, 11, 5, 7, 13, 15};
    return __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
}

/* [sum(v0), sum(v1), ..., sum(v7)]: eight horizontal sums in seven vector additions (and their shuffles). */
static inline vec8 sums8(vec8 v0, vec8 v1, vec8 v2, vec8 v3, vec8 v4, vec8 v5, vec8 v6, vec8 v7)
{
    const vec8 low = pair_sums(pair_sums(v0, v1), pair_sums(v2, v3));  /* v0..v3: first halves, then second */
    const vec8 high = pair_sums(pair_sums(v4, v5), pair_sums(v6, v7));
    const ivec8 first = {0, 1, 2, 3, 8, 9, 10, 11}, second = {4, 5, 6, 7, 12, 13, 14, 15};
    return __builtin_shuffle(low, high, first) + __builtin_shuffle(low, high, second);
}

/* score_token for two keys at once, four query heads at a time (head_dim a multiple of 8 and group of 4): the
 * eight sums reduce together. */
static void score_two_tokens(float *scores, int64_t len, const float *q, int64_t q_head_stride, const float *k0,
                             const float *k1, int64_t group, int64_t head_dim, float scale)
{
    for (int64_t g = 0; g < group; g += 4) {
        const float *q0 = q + g * q_head_stride, *q1 = q0 + q_head_stride, *q2 = q1 + q_head_stride,
                    *q3 = q2 + q_head_stride;
        vec8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
        for (int64_t d = 0; d < head_dim; d += 8) {
            const vec8 x = load8(k0 + d), y = load8(k1 + d);
            const vec8 r0 = load8(q0 + d), r1 = load8(q1 + d), r2 = load8(q2 + d), r3 = load8(q3 + d);
            a0 += r0 * x; a1 += r1 * x; a2 += r2 * x; a3 += r3 * x;
            b0 += r0 * y; b1 += r1 * y; b2 += r2 * y; b3 += r3 * y;
        }
        const vec8 s = sums8(a0, a1, a2, a3, b0, b1, b2, b3) * scale;
        for (int64_t h = 0; h < 4; h++) {
            scores[(g + h) * len] = s[h];
            scores[(g + h) * len + 1] = s[4 + h];
        }
    }
}

/* Ask for the rows of a block's KV heads an item reads (width floats a slot) before they are needed: blocks lie
 * anywhere in the pool, where the hardware prefetcher cannot follow. */
static void prefetch_block(const float *rows, int64_t slots, int64_t slot_stride, int64_t width)
{
    for (int64_t s = 0; s < slots; s++)
        for (int64_t d = 0; d < width; d += 16) /* 16 floats: one 64-byte cache line */
            PREFETCH_TO_L2(rows + s * slot_stride + d);
}

/* The tokens of a len-token context held by the block that starts at token first: all its slots but in the last. */
static inline int64_t block_slots(int64_t len, int64_t first, int64_t block_size)
{
    return len - first < block_size ? len - first : block_size;
}

/* The sizes and strides every work item shares. */
struct shape {
    int64_t head_dim, group, block_size, slot_stride, block_stride, q_head_stride;
    float scale;
};

/* One work item: the query heads of one sequence that share its KV heads kv_first .. kv_first + kv_count - 1.
 * Keys block by block (the item's KV heads' rows of a block, which lie side by side), an exact softmax per query
 * head, then values block by block. scores: [kv_count * group, len]; acc: [kv_count * group, head_dim]. */
/* Inlined into the loop over items, and its buffers declared unaliased: both measurably faster. */
static inline __attribute__((always_inline)) void attend(
    float *restrict out, const float *q, const float *k_cache, const float *v_cache, const int64_t *table,
    int64_t len, int64_t kv_first, int64_t kv_count, const struct shape *sh, float *restrict scores,
    float *restrict acc)
{
    const int64_t group = sh->group, head_dim = sh->head_dim, slot_stride = sh->slot_stride;
    const int64_t block_size = sh->block_size, block_stride = sh->block_stride, heads = kv_count * group;
    const int64_t blocks = (len + block_size - 1) / block_size, width = kv_count * head_dim;
    const int pairs = group % 4 == 0 && head_dim % 8 == 0; /* score_two_tokens' shapes */
    const float *k_item = k_cache + kv_first * head_dim, *v_item = v_cache + kv_first * head_dim;
    const float *q_item = q + kv_first * group * sh->q_head_stride;

    /* Scores: scores[h * len + t] = q_h . k_t * scale, h counting the item's query heads. Each block's values are
     * asked for with its keys: twice the reads in flight while the keys are scored, and the value pass finds most of
     * them in the L2 (it asks again for those that left it: without that, it ran slower than before). */
    if (blocks > 0)
        prefetch_block(v_item + table[0] * block_stride, block_size, slot_stride, width);
    for (int64_t b = 0; b < blocks; b++) {
        if (b + 1 < blocks) {
            prefetch_block(k_item + table[b + 1] * block_stride, block_size, slot_stride, width);
            prefetch_block(v_item + table[b + 1] * block_stride, block_size, slot_stride, width);
        }
        const int64_t first = b * block_size, slots = block_slots(len, first, block_size);
        for (int64_t kv = 0; kv < kv_count; kv++) {
            const float *k_block = k_item + table[b] * block_stride + kv * head_dim;
            const float *q_group = q_item + kv * group * sh->q_head_stride;
            float *group_scores = scores + kv * group * len + first;
            int64_t s = 0;
            if (pairs) /* tested once rather than at every pair: measurably faster */
                for (; s + 2 <= slots; s += 2)
                    score_two_tokens(group_scores + s, len, q_group, sh->q_head_stride, k_block + s * slot_stride,
                                     k_block + (s + 1) * slot_stride, group, head_dim, sh->scale);
            for (; s < slots; s++)
                score_token(group_scores + s, len, q_group, sh->q_head_stride, k_block + s * slot_stride, group,
                            head_dim, sh->scale);
        }
    }
    if (blocks > 0)
        prefetch_block(v_item + table[0] * block_stride, block_size, slot_stride, width);

    /* Softmax of each query head's scores, in place. */
    for (int64_t h = 0; h < heads; h++) {
        float *row = scores + h * len, max = len > 0 ? row[0] : 0.0f, sum = 0.0f;
        for (int64_t t = 1; t < len; t++)
            max = row[t] > max ? row[t] : max;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; t++) {
            row[t] = expf(row[t] - max);
            sum += row[t];
        }
        const float inverse = 1.0f / sum;
        for (int64_t t = 0; t < len; t++)
            row[t] *= inverse;
    }

    /* Weighted sum of the values. */
    for (int64_t i = 0; i < heads * head_dim; i++)
        acc[i] = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        if (b + 1 < blocks)
            prefetch_block(v_item + table[b + 1] * block_stride, block_size, slot_stride, width);
        const int64_t first = b * block_size, slots = block_slots(len, first, block_size);
        for (int64_t kv = 0; kv < kv_count; kv++)
            add_block_values(acc + kv * group * head_dim, scores + kv * group * len + first, len,
                             v_item + table[b] * block_stride + kv * head_dim, slot_stride, slots, group, head_dim);
    }
    float *out_item = out + kv_first * group * head_dim;
    for (int64_t i = 0; i < heads * head_dim; i++)
        out_item[i] = acc[i];
}

/* out: [seqs, heads, head_dim], contiguous. q: [seqs, heads, head_dim] with the given strides (head_dim
 * contiguous). Caches: [blocks, block_size, kv_heads, head_dim], contiguous. block_tables: [seqs, table_stride]
 * int64. context_lens: [seqs] int64, the query token's own key included. Returns 0, or 1 when out of memory. */
int paged_decode_attention_f32(
    float *out, const float *q, int64_t q_seq_stride, int64_t q_head_stride,
    const float *k_cache, const float *v_cache, const int64_t *block_tables, int64_t table_stride,
    const int64_t *context_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale, int64_t max_context_len, int num_threads)
{
    const int64_t slot_stride = num_kv_heads * head_dim;
    const struct shape sh = {head_dim, num_heads / num_kv_heads, block_size, slot_stride, block_size * slot_stride,
                             q_head_stride, scale};
    /* An item with all a sequence's KV heads reads each block in one run, where one item per KV head reads every
     * other stretch of it (faster on a pool larger than the caches: docs/performance.md); with few sequences, one
     * item per KV head keeps every thread busy. Each head's arithmetic is the same either way. */
    const int64_t kv_per_item = num_seqs >= 4 * (int64_t)num_threads ? num_kv_heads : 1;
    const int64_t items_per_seq = num_kv_heads / kv_per_item;
    const int64_t buffer_rows = kv_per_item * sh.group;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * buffer_rows * (max_context_len > 0 ? max_context_len : 1));
        float *acc = malloc(sizeof(float) * buffer_rows * head_dim);
        failed = scores == NULL || acc == NULL;
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < num_seqs * items_per_seq; item++) {
            if (failed)
                continue;
            const int64_t seq = item / items_per_seq, kv_first = item % items_per_seq * kv_per_item;
            attend(out + seq * num_heads * head_dim, q + seq * q_seq_stride, k_cache, v_cache,
                   block_tables + seq * table_stride, context_lens[seq], kv_first, kv_per_item, &sh, scores, acc);
        }
        free(scores);
        free(acc);
    }
    return failed;
}
