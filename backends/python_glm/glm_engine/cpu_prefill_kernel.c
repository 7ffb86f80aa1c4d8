/* Paged attention for one sequence's new tokens on the CPU (a prompt, a prompt chunk, or the rest of a prompt after
 * a cached prefix): causal, grouped-query, float32. Built and loaded by cpu_prefill_kernel.py (c_kernels.py).
 *
 * Both products run on the linear kernel's micro-kernel (cpu_f32_tile.h), the keys and values first packed out of
 * their blocks into its panels, once a call for every query that reads them:
 *   keys:   [kv_heads, ceil(context / PANEL), head_dim, PANEL]: a panel holds PANEL keys, dimension by dimension;
 *   values: [kv_heads, ceil(head_dim / PANEL), padded context, PANEL]: a panel holds PANEL dimensions, token by token.
 * A work item is up to ROWS consecutive new tokens of one query head: their scores against every key up to the last
 * one's position (the tile against the key panels), an exact softmax of each row over the keys its token may see,
 * then the weighted sum of the values (the tile again, the probabilities as its rows). Each token's scores and
 * output are sums in the same order whatever the other rows of its tile, so a token's result depends neither on
 * the other tokens of the call nor on how a prompt is cut into chunks.
 */

#include <math.h>
#include <stdlib.h>

#include "cpu_f32_tile.h"

/* The sizes and strides of one call. */
struct call {
    int64_t new_tokens, context_len, num_heads, group, head_dim, key_panels, value_panels, padded_context;
    int64_t q_seq_stride, q_head_stride;
    float scale;
};

static void pack_keys(float *packed, const float *k_cache, const int64_t *table, int64_t block_size,
                      int64_t slot_stride, const struct call *c, int64_t kv_head, int64_t panel)
{
    float *out = packed + (kv_head * c->key_panels + panel) * c->head_dim * PANEL;
    for (int64_t lane = 0; lane < PANEL; lane++) {
        const int64_t t = panel * PANEL + lane;
        const float *key = t < c->context_len
            ? k_cache + (table[t / block_size] * block_size + t % block_size) * slot_stride + kv_head * c->head_dim
            : NULL;
        for (int64_t d = 0; d < c->head_dim; d++)
            out[d * PANEL + lane] = key ? key[d] : 0.0f;
    }
}

static void pack_values(float *packed, const float *v_cache, const int64_t *table, int64_t block_size,
                        int64_t slot_stride, const struct call *c, int64_t kv_head, int64_t t)
{
    const float *value = t < c->context_len
        ? v_cache + (table[t / block_size] * block_size + t % block_size) * slot_stride + kv_head * c->head_dim
        : NULL;
    for (int64_t panel = 0; panel < c->value_panels; panel++) {
        float *out = packed + ((kv_head * c->value_panels + panel) * c->padded_context + t) * PANEL;
        for (int64_t lane = 0; lane < PANEL; lane++) {
            const int64_t d = panel * PANEL + lane;
            out[lane] = value && d < c->head_dim ? value[d] : 0.0f;
        }
    }
}

/* Row r of scores[rows, stride]: softmax over its first `visible` entries, zero from there to `width`. */
static void softmax_row(float *row, int64_t visible, int64_t width)
{
    float max = row[0], sum = 0.0f;
    for (int64_t t = 1; t < visible; t++)
        max = row[t] > max ? row[t] : max;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < visible; t++) {
        row[t] = expf(row[t] - max);
        sum += row[t];
    }
    const float inverse = 1.0f / sum;
    for (int64_t t = 0; t < visible; t++)
        row[t] *= inverse;
    for (int64_t t = visible; t < width; t++)
        row[t] = 0.0f;
}

/* Tokens first .. first + rows - 1 (rows <= ROWS) of query head `head`. queries: [ROWS, head_dim] scratch; scores:
 * [ROWS, padded_context] scratch. */
static void attend(float *out, const float *q, const float *keys, const float *values, const struct call *c,
                   int64_t head, int64_t first, int rows, float *queries, float *scores)
{
    const int64_t kv_head = head / c->group, head_dim = c->head_dim, stride = c->padded_context;
    const int64_t offset = c->context_len - c->new_tokens; /* new token i sits at position offset + i */
    const int64_t seen = offset + first + rows;            /* keys the last row may see */
    const int64_t panels = (seen + PANEL - 1) / PANEL;
    for (int r = 0; r < rows; r++)
        for (int64_t d = 0; d < head_dim; d++)
            queries[r * head_dim + d] = q[(first + r) * c->q_seq_stride + head * c->q_head_stride + d] * c->scale;

#define TILE(COUNT)                                                                                             \
    tile(scores + p * PANEL, stride, queries, head_dim, head_dim,                                              \
         keys + (kv_head * c->key_panels + p) * head_dim * PANEL, NULL, PANEL, COUNT)
    for (int64_t p = 0; p < panels; p++)
        RUN_TILE(rows)
#undef TILE
    for (int r = 0; r < rows; r++)
        softmax_row(scores + r * stride, offset + first + r + 1, seen);
#define TILE(COUNT)                                                                                             \
    tile(out_rows + p * PANEL, out_stride, scores, stride, seen,                                               \
         values + (kv_head * c->value_panels + p) * stride * PANEL, NULL, width, COUNT)
    float *out_rows = out + (first * c->num_heads + head) * head_dim;
    const int64_t out_stride = c->num_heads * head_dim;
    for (int64_t p = 0; p < c->value_panels; p++) {
        const int64_t width = head_dim - p * PANEL < PANEL ? head_dim - p * PANEL : PANEL;
        RUN_TILE(rows)
    }
#undef TILE
}

/* out: [new_tokens, num_heads, head_dim], contiguous. q: [new_tokens, num_heads, head_dim] with the given strides
 * (head_dim contiguous), new token i at position context_len - new_tokens + i. Caches: [blocks, block_size,
 * kv_heads, head_dim], contiguous; block_table: the sequence's blocks. Returns 0, or 1 when out of memory. */
int paged_prefill_attention_f32(
    float *out, const float *q, int64_t q_seq_stride, int64_t q_head_stride, const float *k_cache,
    const float *v_cache, const int64_t *block_table, int64_t context_len, int64_t new_tokens, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, int num_threads)
{
    const int64_t key_panels = (context_len + PANEL - 1) / PANEL, slot_stride = num_kv_heads * head_dim;
    const struct call c = {new_tokens, context_len, num_heads, num_heads / num_kv_heads, head_dim, key_panels,
                           (head_dim + PANEL - 1) / PANEL, key_panels * PANEL, q_seq_stride, q_head_stride, scale};
    float *keys = malloc(sizeof(float) * num_kv_heads * key_panels * head_dim * PANEL);
    float *values = malloc(sizeof(float) * num_kv_heads * c.value_panels * c.padded_context * PANEL);
    const int64_t tiles = (new_tokens + ROWS - 1) / ROWS;
    int failed = keys == NULL || values == NULL;
    if (!failed) {
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
        {
#pragma omp for schedule(static) nowait
            for (int64_t item = 0; item < num_kv_heads * key_panels; item++)
                pack_keys(keys, k_cache, block_table, block_size, slot_stride, &c, item / key_panels,
                          item % key_panels);
#pragma omp for schedule(static)
            for (int64_t item = 0; item < num_kv_heads * c.padded_context; item++)
                pack_values(values, v_cache, block_table, block_size, slot_stride, &c, item / c.padded_context,
                            item % c.padded_context);
            float *queries = malloc(sizeof(float) * ROWS * head_dim);
            float *scores = malloc(sizeof(float) * ROWS * c.padded_context);
            failed = queries == NULL || scores == NULL;
            /* Later tiles see more keys: the largest first, so that the last ones to start are the shortest. */
#pragma omp for schedule(dynamic)
            for (int64_t item = 0; item < num_heads * tiles; item++) {
                if (failed)
                    continue;
                const int64_t tile_index = tiles - 1 - item / num_heads, first = tile_index * ROWS;
                const int rows = new_tokens - first < ROWS ? (int)(new_tokens - first) : ROWS;
                attend(out, q, keys, values, &c, item % num_heads, first, rows, queries, scores);
            }
            free(queries);
            free(scores);
        }
    }
    free(keys);
    free(values);
    return failed;
}
