"""INT8 linear layers on x86 CPUs with AVX2 and no VNNI, in C (cpu_int8_kernel.c): activations quantized per token
to 7 bits inside the call, weights per output channel to 7 bits and packed once at load.

There, torch._int_mm falls back to a plain loop and oneDNN's uint8 x int8 product ran at float32's speed or below
(its AVX2 instruction adds pairs of products in 16 bits, one widening multiply per step); keeping both sides to 7 bits
lets this kernel add two steps before widening (docs/quantization.md, CPUs without VNNI). Compiled on first use for
this CPU (c_kernels.py); without AVX2 or a compiler, load() raises KernelUnavailable.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .c_kernels import load_library

SOURCE = Path(__file__).with_suffix(".c")
PANEL = 16  # output channels a panel: as in the C source
GROUP = 8  # input channels a step: the packed input is padded to a multiple of it
WEIGHT_MAX = 63  # 7-bit weights and activations: two steps' 16-bit sums cannot overflow (the C source says why)
ACTIVATION_MAX = 63.0


@functools.cache
def load() -> tuple:
    """The kernel's (pack, linear) C functions, built on first use. Raises KernelUnavailable."""
    library = load_library(SOURCE)
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    pack, linear = library.pack_linear_weight_i8, library.linear_i8
    pack.argtypes, pack.restype = [pointer, pointer, pointer, i64, i64, i64], None
    linear.argtypes = [pointer, pointer, i64, pointer, pointer, pointer, pointer, i64, i64, i64, pointer, pointer,
                       ctypes.c_int]
    linear.restype = None
    return pack, linear


def padded(in_features: int) -> int:
    return -(-in_features // GROUP) * GROUP


def pack_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [out, in] int8 within +-WEIGHT_MAX -> (packed [ceil(out / PANEL), padded in * PANEL] int8,
    compensation [out] int32)."""
    out_features, in_features = weight.shape
    weight = weight.detach().contiguous()
    assert weight.dtype == torch.int8 and weight.device.type == "cpu", "int8 on the CPU only"
    assert int(weight.abs().max()) <= WEIGHT_MAX, f"weights within +-{WEIGHT_MAX} only"
    packed = torch.empty(-(-out_features // PANEL), padded(in_features) * PANEL, dtype=torch.int8)
    compensation = torch.empty(out_features, dtype=torch.int32)
    load()[0](packed.data_ptr(), compensation.data_ptr(), weight.data_ptr(), out_features, in_features,
              padded(in_features))
    return packed, compensation


def linear(x: torch.Tensor, packed: torch.Tensor, compensation: torch.Tensor, weight_scale: torch.Tensor,
           bias: torch.Tensor | None, scratch: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [rows, in] float32 times the packed weight, scaled per channel by weight_scale [out] (+ bias) -> float32
    [rows, out], on torch's threads. scratch: (uint8 [rows, padded in], float32 [rows]) to hold x quantized (tests
    read it); by default fresh tensors."""
    x = x.contiguous()
    rows, in_features = x.shape
    out_features = compensation.shape[0]
    assert x.dtype == torch.float32 and packed.shape[1] == padded(in_features) * PANEL
    values, token_scales = scratch or (torch.empty(rows, padded(in_features), dtype=torch.uint8), torch.empty(rows))
    out = torch.empty(rows, out_features)
    load()[1](out.data_ptr(), x.data_ptr(), rows, packed.data_ptr(), compensation.data_ptr(), weight_scale.data_ptr(),
              None if bias is None else bias.data_ptr(), out_features, in_features, padded(in_features),
              values.data_ptr(), token_scales.data_ptr(), torch.get_num_threads())
    return out
