"""Paged-attention decode on the CPU in C (cpu_decode_kernel.c): keys and values read from their blocks in place.

The torch path gathers every decoding sequence's blocks into one padded tensor before SDPA reads them: the KV cache
is copied once a layer a step. This kernel reads the blocks where they are, so a decode step's attention touches
each key and value once. It has the signature of the Triton-language kernel (paged_decode_kernel.py), which covers
CUDA; there is no Triton backend for the CPU.

Compiled on first use for this CPU (c_kernels.py). Where it cannot be built, load() raises KernelUnavailable saying
why, and the engine keeps the torch path (attention_backend auto) or refuses to start (attention_backend cpu).
float32 only.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .c_kernels import load_library

SOURCE = Path(__file__).with_suffix(".c")


@functools.cache
def load():
    """The kernel's C function, built on first use. Raises KernelUnavailable."""
    function = load_library(SOURCE).paged_decode_attention_f32
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    function.argtypes = [pointer, pointer, i64, i64, pointer, pointer, pointer, i64, pointer,
                         i64, i64, i64, i64, i64, ctypes.c_float, i64, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [seqs, heads, head_dim] float32, one token per sequence; caches: [blocks, block_size, kv_heads, head_dim];
    block_tables: [seqs, max_blocks]; context_lens: [seqs] (the query token included). Returns [seqs, heads,
    head_dim]. On the threads torch uses (torch.get_num_threads())."""
    num_seqs, num_heads, head_dim = q.shape
    if q.stride(2) != 1:
        q = q.contiguous()
    assert q.dtype == k_cache.dtype == v_cache.dtype == torch.float32, "float32 only"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    block_tables = block_tables.to(torch.int64).contiguous()
    context_lens = context_lens.to(torch.int64).contiguous()
    out = torch.empty(num_seqs, num_heads, head_dim)
    max_context_len = int(context_lens.max()) if num_seqs else 0
    failed = load()(
        out.data_ptr(), q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(),
        num_seqs, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], scale, max_context_len,
        torch.get_num_threads())
    if failed:
        raise MemoryError(f"the CPU decode kernel could not allocate its scores ({max_context_len} tokens)")
    return out
