"""Paged-attention decode kernel in the Triton language: one query token per sequence, keys and values read
through the block table, grouped-query heads, softmax computed online over the blocks.

Used on CUDA for decode-only steps (attention.paged_attention picks it); the tests run it on the CPU under
TRITON_INTERPRET=1 against the torch path. Imported only where it is used, so the engine never needs `triton`
on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, scale,
    stride_q_token, stride_q_head,
    stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_table_seq,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    dims = tl.arange(0, HEAD_DIM)
    slots = tl.arange(0, BLOCK_SIZE)

    q = tl.load(q_ptr + seq * stride_q_token + head * stride_q_head + dims).to(tl.float32)
    context_len = tl.load(context_lens_ptr + seq)

    running_max = tl.full([1], float("-inf"), tl.float32)
    running_sum = tl.zeros([1], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for block_index in range(0, tl.cdiv(context_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * stride_table_seq + block_index)
        valid = block_index * BLOCK_SIZE + slots < context_len
        offsets = (block * stride_cache_block + slots[:, None] * stride_cache_slot + kv_head * stride_cache_head
                   + dims[None, :])
        k = tl.load(k_cache_ptr + offsets, mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + offsets, mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.sum(k * q[None, :], axis=1) * scale
        scores = tl.where(valid, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=0))
        correction = tl.exp(running_max - new_max)
        weights = tl.exp(scores - new_max)
        running_sum = running_sum * correction + tl.sum(weights, axis=0)
        acc = acc * correction + tl.sum(weights[:, None] * v, axis=0)
        running_max = new_max
    out = acc / running_sum
    tl.store(out_ptr + seq * stride_q_token + head * stride_q_head + dims, out.to(out_ptr.dtype.element_ty))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [seqs, heads, head_dim], one token per sequence; caches: [blocks, block_size, kv_heads, head_dim];
    block_tables: [seqs, max_blocks]; context_lens: [seqs] (the query token included). Returns like q."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert head_dim & (head_dim - 1) == 0 and block_size & (block_size - 1) == 0, "powers of two only"
    q = q.contiguous()
    out = torch.empty_like(q)
    block_tables = block_tables.to(torch.int32).contiguous()
    _paged_decode_kernel[(num_seqs, num_heads)](
        out, q, k_cache, v_cache, block_tables, context_lens.to(torch.int32).contiguous(), scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
    )
    return out
