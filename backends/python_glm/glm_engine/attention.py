"""Attention over the paged KV cache: the plain torch path, which reads keys and values through block tables.

A step's batch is flat: sequence b contributes `query_lens[b]` new tokens (a whole prompt, a prompt chunk or one
decode token) that attend to the first `context_lens[b]` tokens of that sequence, its new tokens included.
So one function serves prefill, chunked prefill, decode and any mix of them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Decode-only steps attend in groups of this many sequences of similar context length, so that each group's keys
# are padded only to its own longest context, not to the batch's longest.
DECODE_GROUP = 8


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] flat KV slot (block * block_size + offset) each new token writes
    block_tables: torch.Tensor  # [seqs, max_blocks] block ids, padded with 0
    context_lens: torch.Tensor  # [seqs] tokens in the cache after this step, new ones included
    # The same lengths on the host, so that splitting the batch never waits for the device.
    query_lens: list[int]  # new tokens per sequence; sequence b's are rows sum(query_lens[:b]) onwards
    host_context_lens: list[int]
    # What attends the decoding rows: "torch" (gather, then SDPA), "triton" (paged_decode_kernel.py, CUDA) or
    # "cpu" (cpu_decode_kernel.py, and then cpu_prefill_kernel.py the prefilling ones; others prefill with
    # torch); ModelRunner picks it (choose_decode_kernel).
    decode_kernel: str = "torch"

    @property
    def decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens)


def write_kv(k_cache, v_cache, k, v, slot_mapping) -> None:
    """Store the new tokens' keys and values. Caches: [num_blocks, block_size, kv_heads, head_dim]."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [tokens, heads, head_dim] -> [tokens, heads, head_dim], causal within each sequence."""
    decode_attention = decode_attention_function(meta.decode_kernel)
    if meta.decode_only:  # one token per sequence, in order
        return decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)

    # A mixed step: the decoding sequences attend together and each prefilling one on its own, so that no sequence
    # is padded to another's length.
    out = torch.empty_like(q)
    starts = [0]
    for n in meta.query_lens:
        starts.append(starts[-1] + n)
    decoding = [b for b, n in enumerate(meta.query_lens) if n == 1]
    if decoding:
        seqs = torch.tensor(decoding, device=q.device)
        rows = torch.tensor([starts[b] for b in decoding], device=q.device)
        out[rows] = decode_attention(q[rows], k_cache, v_cache, meta.block_tables[seqs], meta.context_lens[seqs],
                                     scale)
    prefill_attention = prefill_attention_function(meta.decode_kernel)
    for b, (n, context_len) in enumerate(zip(meta.query_lens, meta.host_context_lens)):
        if n > 1:
            rows = slice(starts[b], starts[b] + n)
            prefill_attention(q[rows], k_cache, v_cache, meta.block_tables[b], context_len, scale, out[rows])
    return out


@functools.cache
def decode_attention_function(kernel: str):
    """The function for one query token per sequence: (q, k_cache, v_cache, block_tables, context_lens, scale).
    The kernels are imported only where they are used: the Triton one needs `triton`, the CPU one a compiler."""
    if kernel == "triton":
        from .paged_decode_kernel import paged_decode_attention
    elif kernel == "cpu":
        from .cpu_decode_kernel import paged_decode_attention
    else:
        paged_decode_attention = _decode_attention
    return paged_decode_attention


@functools.cache
def prefill_attention_function(kernel: str):
    """The function for one sequence's new tokens: (q, k_cache, v_cache, block_table, context_len, scale, out),
    writing out. The C kernel beside the CPU decode kernel; else torch (the Triton kernel decodes only)."""
    if kernel == "cpu":
        from .cpu_prefill_kernel import paged_prefill_attention
        return paged_prefill_attention
    return _prefill_attention


def _prefill_attention(q, k_cache, v_cache, block_table, context_len: int, scale: float,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's new tokens q [n, heads, head_dim], the last n of its context_len tokens; written into out
    when given."""
    n = q.shape[0]
    keys, values = _gather(k_cache, v_cache, block_table[None], context_len)
    keys, values = keys[0, :context_len].transpose(0, 1), values[0, :context_len].transpose(0, 1)
    if n == context_len:  # a whole prompt: plain causal
        mask, causal = None, True
    else:  # a chunk, or the rest of a prompt after a cached prefix: query i sits at context_len - n + i
        positions = torch.arange(context_len, device=q.device)
        mask, causal = positions[None, :] <= positions[context_len - n:, None], False
    # A batch of one, not 3-D tensors: with enable_gqa, 3-D inputs fall back to the slower math path on the CPU.
    attended = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
                                              is_causal=causal, scale=scale, enable_gqa=True)[0].transpose(0, 1)
    if out is None:
        return attended
    out.copy_(attended)
    return out


def _gather(k_cache, v_cache, block_tables, max_context_len: int):
    """Each sequence's keys and values in order: [seqs, blocks * block_size, kv_heads, head_dim], padded.
    index_select copies whole blocks, much faster on the CPU than advanced indexing (k_cache[tables])."""
    block_size = k_cache.shape[1]
    num_blocks = -(-max_context_len // block_size)
    tables = block_tables[:, :num_blocks].reshape(-1)
    shape = (block_tables.shape[0], num_blocks * block_size, *k_cache.shape[2:])
    return k_cache.index_select(0, tables).view(shape), v_cache.index_select(0, tables).view(shape)


def _decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale: float) -> torch.Tensor:
    """One query per sequence; groups of sequences sorted by context length, each padded to its own longest.
    The query heads that share a KV head attend as rows of one product ([kv_heads, group, head_dim] against that
    head's keys) rather than one vector product each, which enable_gqa does."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    grouped_q = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = torch.empty_like(grouped_q)
    order = torch.argsort(context_lens)
    for start in range(0, order.numel(), DECODE_GROUP):
        rows = order[start:start + DECODE_GROUP]
        lengths = context_lens[rows]
        keys, values = _gather(k_cache, v_cache, block_tables[rows], int(lengths.max()))
        mask = (torch.arange(keys.shape[1], device=q.device) < lengths[:, None])[:, None, None, :]
        out[rows] = F.scaled_dot_product_attention(grouped_q[rows], keys.transpose(1, 2), values.transpose(1, 2),
                                                   attn_mask=mask, scale=scale)
    return out.view(num_seqs, num_heads, head_dim)
