/* Paged-attention decode on the CPU: one query token per sequence, keys and values read from their KV blocks in
 * place (the torch path first copies every sequence's blocks into one padded tensor, then runs SDPA over it).
 *
 * Built and loaded by cpu_decode_kernel.py: compiled with -ffast-math (so that expf vectorizes), linked without it
 * (a shared object linked with it would switch the whole process to flush-to-zero). No torch headers: plain C and
 * OpenMP, whose runtime is the one torch has already loaded.
 *
 * Work items are (sequence, KV head) pairs, shared out between threads. Each item computes, for the query heads
 * that share its KV head, the scores against every key of the context, an exact softmax over them, then the
 * weighted sum of the values: keys read once, values read once, whatever the group size. Nothing depends on the
 * other sequences of the batch, so a sequence's output is the same whatever it is batched with.
 *
 * Eight floats at a time through GCC's vector extension (AVX2 or AVX-512 on x86, NEON on Arm, as -march=native
 * allows), four query heads at a time, so that the products of one key or value run in independent sums.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* Ask for one KV head's rows of a block before they are needed: blocks lie anywhere in the pool, where the
 * hardware prefetcher cannot follow. */
static void prefetch_block(const float *rows, int64_t slots, int64_t slot_stride, int64_t head_dim)
{
    for (int64_t s = 0; s < slots; s++)
        for (int64_t d = 0; d < head_dim; d += 16) /* 16 floats: one 64-byte cache line */
            __builtin_prefetch(rows + s * slot_stride + d, 0, 3);
}

/* The tokens of a len-token context held by the block that starts at token first: all its slots but in the last. */
static inline int64_t block_slots(int64_t len, int64_t first, int64_t block_size)
{
    return len - first < block_size ? len - first : block_size;
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
    const int64_t group = num_heads / num_kv_heads;
    const int64_t slot_stride = num_kv_heads * head_dim, block_stride = block_size * slot_stride;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * group * (max_context_len > 0 ? max_context_len : 1));
        float *acc = malloc(sizeof(float) * group * head_dim);
        failed = scores == NULL || acc == NULL;
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < num_seqs * num_kv_heads; item++) {
            if (failed)
                continue;
            const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
            const int64_t len = context_lens[seq], blocks = (len + block_size - 1) / block_size;
            const int64_t *table = block_tables + seq * table_stride;
            const float *q_group = q + seq * q_seq_stride + kv_head * group * q_head_stride;
            const float *k_head = k_cache + kv_head * head_dim, *v_head = v_cache + kv_head * head_dim;
            float *out_group = out + (seq * num_heads + kv_head * group) * head_dim;

            /* Scores: scores[g * len + t] = q_g . k_t * scale. */
            for (int64_t b = 0; b < blocks; b++) {
                if (b + 1 < blocks)
                    prefetch_block(k_head + table[b + 1] * block_stride, block_size, slot_stride, head_dim);
                const float *k_block = k_head + table[b] * block_stride;
                const int64_t first = b * block_size, slots = block_slots(len, first, block_size);
                for (int64_t s = 0; s < slots; s++)
                    score_token(scores + first + s, len, q_group, q_head_stride, k_block + s * slot_stride, group,
                                head_dim, scale);
            }
            if (blocks > 0)
                prefetch_block(v_head + table[0] * block_stride, block_size, slot_stride, head_dim);

            /* Softmax of each query head's scores, in place. */
            for (int64_t g = 0; g < group; g++) {
                float *row = scores + g * len, max = len > 0 ? row[0] : 0.0f, sum = 0.0f;
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
            for (int64_t i = 0; i < group * head_dim; i++)
                acc[i] = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                if (b + 1 < blocks)
                    prefetch_block(v_head + table[b + 1] * block_stride, block_size, slot_stride, head_dim);
                const int64_t first = b * block_size;
                add_block_values(acc, scores + first, len, v_head + table[b] * block_stride, slot_stride,
                                 block_slots(len, first, block_size), group, head_dim);
            }
            for (int64_t i = 0; i < group * head_dim; i++)
                out_group[i] = acc[i];
        }
        free(scores);
        free(acc);
    }
    return failed;
}
