"""Paged attention for one sequence's new tokens on the CPU in C (cpu_prefill_kernel.c): prompts and prompt chunks.

The torch path copies the sequence's blocks into one tensor and runs SDPA over it, which reached about 70 GFLOP/s
on the bench model's prompts here; this kernel packs the keys and values once a call into the float32 linear
kernel's panels and runs both products on its micro-kernel (docs/performance.md). Compiled on first use for this
CPU (c_kernels.py); chosen with the decode kernel (attention_backend auto or cpu, float32 on the CPU), and where it
cannot be built load() raises KernelUnavailable saying why.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .c_kernels import load_library

SOURCE = Path(__file__).with_suffix(".c")


@functools.cache
def load(extra_flags: tuple[str, ...] = ()):
    """The kernel's C function, built on first use (extra_flags: c_kernels.build). Raises KernelUnavailable."""
    function = load_library(SOURCE, extra_flags).paged_prefill_attention_f32
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    function.argtypes = [pointer, pointer, i64, i64, pointer, pointer, pointer, i64, i64, i64, i64, i64, i64,
                         ctypes.c_float, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, context_len: int, scale: float,
                            out: torch.Tensor | None = None, extra_flags: tuple[str, ...] = ()) -> torch.Tensor:
    """q: [n, heads, head_dim] float32, the last n of the sequence's context_len tokens, each attending causally
    to the tokens up to its own; caches: [blocks, block_size, kv_heads, head_dim]; block_table: [>= blocks used].
    Writes and returns out ([n, heads, head_dim], contiguous; by default a new tensor). On torch's threads."""
    new_tokens, num_heads, head_dim = q.shape
    if q.stride(2) != 1:
        q = q.contiguous()
    assert q.dtype == k_cache.dtype == v_cache.dtype == torch.float32, "float32 only"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert 0 < new_tokens <= context_len
    block_table = block_table.to(torch.int64).contiguous()
    if out is None:
        out = torch.empty(new_tokens, num_heads, head_dim)
    assert out.shape == q.shape and out.is_contiguous()
    failed = load(extra_flags)(
        out.data_ptr(), q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
        block_table.data_ptr(), context_len, new_tokens, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1],
        scale, torch.get_num_threads())
    if failed:
        raise MemoryError(f"the CPU prefill kernel could not allocate its panels ({context_len} tokens)")
    return out
