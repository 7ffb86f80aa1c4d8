"""Attention over the paged KV cache: the plain torch path, which reads keys and values through block tables.

A step's batch is flat: sequence b contributes `query_lens[b]` new tokens (a whole prompt, a prompt chunk or one
decode token) that attend to the first `context_lens[b]` tokens of that sequence, its new tokens included.
Prefill, chunked prefill and decode are therefore one code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Decode-only steps attend in groups of this many sequences of similar context length, so that each group's keys
# are padded only to its own longest context (16% faster on the benchmark mix than padding the whole batch).
DECODE_GROUP = 8


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] flat KV slot (block * block_size + offset) each new token writes
    block_tables: torch.Tensor  # [seqs, max_blocks] block ids, padded with 0
    query_lens: torch.Tensor  # [seqs] new tokens per sequence
    context_lens: torch.Tensor  # [seqs] tokens in the cache after this step, new ones included
    token_seq: torch.Tensor  # [tokens] which sequence each new token belongs to
    token_offset: torch.Tensor  # [tokens] its index among that sequence's new tokens
    max_query_len: int
    max_context_len: int
    # Decode-only steps may use the Triton-language kernel (see ModelRunner for when).
    use_decode_kernel: bool = False


def write_kv(k_cache, v_cache, k, v, slot_mapping) -> None:
    """Store the new tokens' keys and values. Caches: [num_blocks, block_size, kv_heads, head_dim]."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [tokens, heads, head_dim] -> [tokens, heads, head_dim], causal within each sequence."""
    if meta.max_query_len == 1:  # decode only: one token per sequence, in order
        if meta.use_decode_kernel:
            from .triton_attention import paged_decode_attention

            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
        return _decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
    num_seqs = meta.query_lens.shape[0]
    keys, values = _gather(k_cache, v_cache, meta.block_tables, meta.max_context_len)

    padded_q = q.new_zeros(num_seqs, meta.max_query_len, *q.shape[1:])
    padded_q[meta.token_seq, meta.token_offset] = q

    # Query i of sequence b sits at position context_len - query_len + i and sees keys at positions <= its own.
    device = q.device
    query_pos = (meta.context_lens - meta.query_lens)[:, None] + torch.arange(meta.max_query_len, device=device)
    key_pos = torch.arange(keys.shape[1], device=device)
    mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos < meta.context_lens[:, None])[:, None, :]

    out = F.scaled_dot_product_attention(
        padded_q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=mask[:, None], scale=scale, enable_gqa=True,
    )
    return out.transpose(1, 2)[meta.token_seq, meta.token_offset]


def _gather(k_cache, v_cache, block_tables, max_context_len: int):
    """Each sequence's keys and values in order: [seqs, blocks * block_size, kv_heads, head_dim], padded.
    index_select copies whole blocks; advanced indexing (k_cache[tables]) was 4x slower on the CPU."""
    block_size = k_cache.shape[1]
    num_blocks = -(-max_context_len // block_size)
    tables = block_tables[:, :num_blocks].reshape(-1)
    shape = (block_tables.shape[0], num_blocks * block_size, *k_cache.shape[2:])
    return k_cache.index_select(0, tables).view(shape), v_cache.index_select(0, tables).view(shape)


def _decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale: float) -> torch.Tensor:
    """One query per sequence; groups of sequences sorted by context length, each padded to its own longest."""
    out = torch.empty_like(q)
    order = torch.argsort(context_lens)
    for start in range(0, order.numel(), DECODE_GROUP):
        rows = order[start:start + DECODE_GROUP]
        lengths = context_lens[rows]
        keys, values = _gather(k_cache, v_cache, block_tables[rows], int(lengths.max()))
        mask = (torch.arange(keys.shape[1], device=q.device) < lengths[:, None])[:, None, None, :]
        group_out = F.scaled_dot_product_attention(
            q[rows][:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=mask, scale=scale, enable_gqa=True,
        )
        out[rows] = group_out[:, :, 0, :]
    return out
