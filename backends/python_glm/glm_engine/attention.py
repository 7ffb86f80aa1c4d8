"""Attention over the paged KV cache: the plain torch path, which reads keys and values through block tables.

A step's batch is flat: sequence b contributes `query_lens[b]` new tokens (a whole prompt, a prompt chunk or one
decode token) that attend to the first `context_lens[b]` tokens of that sequence, its new tokens included.
Prefill, chunked prefill and decode are therefore one code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
    if meta.use_decode_kernel and meta.max_query_len == 1:
        from .triton_attention import paged_decode_attention  # one token per sequence, in order

        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
    num_seqs = meta.query_lens.shape[0]
    block_size = k_cache.shape[1]
    num_blocks = -(-meta.max_context_len // block_size)
    tables = meta.block_tables[:, :num_blocks].reshape(-1)
    # Gather each sequence's keys and values in order: [seqs, blocks * block_size, kv_heads, head_dim].
    # index_select copies whole blocks; advanced indexing (k_cache[tables]) was 4x slower on the CPU.
    gathered_shape = (num_seqs, num_blocks * block_size, *k_cache.shape[2:])
    keys = k_cache.index_select(0, tables).view(gathered_shape)
    values = v_cache.index_select(0, tables).view(gathered_shape)

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
