"""The torch paged-attention path against plain attention over contiguous keys, on a mixed step.

One step's batch holds decoding sequences, a whole prompt, a prompt chunk after earlier chunks and a prompt
after a cached prefix; their blocks lie scattered through the pool, as a fragmented pool would give them."""

from __future__ import annotations

import torch

from glm_engine.attention import AttentionMetadata, paged_attention


def reference(q, keys, values, scale):
    """q: [n, heads, d] for the last n of the context's keys/values [context, kv_heads, d]."""
    n, context = q.shape[0], keys.shape[0]
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
    visible = torch.arange(context)[None, :] <= torch.arange(context - n, context)[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, values)


def test_a_mixed_step_matches_attention_over_contiguous_keys():
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, block_size, num_blocks = 8, 2, 16, 4, 96
    # (new tokens, context after the step): decodes, a whole prompt, a chunk, a prompt after a cached prefix.
    layout = [(1, 9), (23, 23), (1, 30), (6, 14), (1, 2), (5, 21)]
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator)
    max_blocks = -(-max(context for _, context in layout) // block_size)
    tables = torch.randperm(num_blocks, generator=generator)[: len(layout) * max_blocks].view(len(layout), max_blocks)
    q = torch.randn(sum(n for n, _ in layout), heads, head_dim, generator=generator)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(q.shape[0], dtype=torch.long), block_tables=tables,
        context_lens=torch.tensor([context for _, context in layout]),
        query_lens=[n for n, _ in layout], host_context_lens=[context for _, context in layout])

    got = paged_attention(q, k_cache, v_cache, meta, scale=0.25)

    start = 0
    for b, (n, context) in enumerate(layout):
        slots = [int(tables[b, pos // block_size]) * block_size + pos % block_size for pos in range(context)]
        keys, values = k_cache.view(-1, kv_heads, head_dim)[slots], v_cache.view(-1, kv_heads, head_dim)[slots]
        expected = reference(q[start:start + n], keys, values, scale=0.25)
        torch.testing.assert_close(got[start:start + n], expected, atol=1e-5, rtol=1e-5)
        start += n
