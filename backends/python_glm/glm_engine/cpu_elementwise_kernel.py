"""The element-wise work of a decoder layer on the CPU in C (cpu_elementwise_kernel.c): RMSNorm with the residual
addition before it, SiLU(gate) * up, and the rotary embedding of queries and keys with the store of keys and values
into the KV cache, one pass each instead of five or more torch operators.

Compiled on first use for this CPU (c_kernels.py), with the linear kernel: the engine uses both where it chose
layer_backend cpu (glm_model.GlmForCausalLM.load_weights). Float32 only.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .c_kernels import load_library

SOURCE = Path(__file__).with_suffix(".c")


@functools.cache
def load() -> tuple:
    """The kernel's (rms_norm, silu_and_mul, rotary_store_kv) C functions, built on first use. Raises
    KernelUnavailable."""
    library = load_library(SOURCE)
    pointer, i64, threads = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    norm, silu_and_mul, rotary = library.rms_norm_f32, library.silu_and_mul_f32, library.rotary_store_kv_f32
    norm.argtypes = [pointer, pointer, pointer, pointer, pointer, i64, i64, ctypes.c_float, threads]
    silu_and_mul.argtypes = [pointer, pointer, i64, i64, threads]
    rotary.argtypes = [pointer, i64, i64, i64, i64, i64, pointer, pointer, pointer, pointer, pointer, threads]
    norm.restype = silu_and_mul.restype = rotary.restype = None
    return norm, silu_and_mul, rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [rows, cols] float32 normalized and scaled by weight [cols]; with residual, x + residual is normalized and
    also returned (else None)."""
    x = x.contiguous()  # kept in names until the call returns: the C side reads their memory
    residual = None if residual is None else residual.contiguous()
    rows, cols = x.shape
    out = torch.empty_like(x)
    total = None if residual is None else torch.empty_like(x)
    load()[0](out.data_ptr(), None if total is None else total.data_ptr(), x.data_ptr(),
              None if residual is None else residual.data_ptr(), weight.data_ptr(), rows, cols, eps,
              torch.get_num_threads())
    return out, total


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [rows, 2 * cols] float32 -> silu(gate) * up, [rows, cols]."""
    gate_up = gate_up.contiguous()
    rows, cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, cols)
    load()[1](out.data_ptr(), gate_up.data_ptr(), rows, cols, torch.get_num_threads())
    return out


def rotary_and_store_kv(qkv: torch.Tensor, heads: int, rotary_dim: int, angles: tuple[torch.Tensor, torch.Tensor],
                        slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """qkv [tokens, heads + 2 * kv_heads, head_dim] float32, contiguous: its queries and keys rotated in place by
    angles (cos, sin: [tokens, 1, rotary_dim / 2], RotaryEmbedding.angles), its keys and values written to the slots
    of slot_mapping [tokens] in k_cache and v_cache ([blocks, block_size, kv_heads, head_dim])."""
    tokens, width, head_dim = qkv.shape
    cos, sin = (a.contiguous() for a in angles)
    slots = slot_mapping.contiguous()
    assert qkv.is_contiguous() and qkv.dtype == cos.dtype == k_cache.dtype == torch.float32
    assert slots.dtype == torch.int64 and k_cache.is_contiguous() and v_cache.is_contiguous()
    load()[2](qkv.data_ptr(), tokens, heads, (width - heads) // 2, head_dim, rotary_dim, cos.data_ptr(),
              sin.data_ptr(), slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), torch.get_num_threads())
