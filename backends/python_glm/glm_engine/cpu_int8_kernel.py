"""INT8 linear layers on x86 CPUs in C (cpu_int8_kernel.c): activations quantized per token inside the call, weights
per output channel and packed once at load.

With AVX-512 VNNI the build sums 8-bit weights and activations (the integers torch._int_mm would) in one pass with
the quantizing and rescaling that cost _int_mm's path as much as its product at decode sizes; with AMX too, its tile
instructions make the same sums (the same bits out), 16 VNNI instructions' work in one. Linux lets a process use AMX
only once asked (load() asks); where it refuses, the kernel is built without AMX. With AVX2 and no VNNI,
where torch._int_mm falls back to a plain loop and oneDNN's uint8 x int8 product ran at float32's speed or below, it
keeps weights and activations to 7 bits so that it can add two steps before widening (docs/quantization.md, CPUs
without VNNI). Compiled on first use for this CPU (c_kernels.py); without AVX2 or a compiler, load() raises
KernelUnavailable.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from .c_kernels import load_library

SOURCE = Path(__file__).with_suffix(".c")
WITHOUT_AMX = ("-mno-amx-tile", "-mno-amx-int8")
log = logging.getLogger(__name__)


class Int8Kernel(NamedTuple):
    pack: Callable
    linear: Callable
    panel: int  # output channels a panel
    value_max: int  # weights and activations within +-value_max: 127 with VNNI, 63 with AVX2 alone
    group: int  # the packed input is padded to a multiple of it: 64 with AMX (a tile's depth), else 8

    @property
    def uses_amx(self) -> bool:
        return self.group == 64

    def padded(self, in_features: int) -> int:
        return -(-in_features // self.group) * self.group


@functools.cache
def load(extra_flags: tuple[str, ...] = ()) -> Int8Kernel:
    """The kernel built on first use (extra_flags: c_kernels.build). Raises KernelUnavailable."""
    library = load_library(SOURCE, extra_flags)
    if refused := library.linear_i8_init():
        log.warning("Linux refused this process AMX tiles (%s): the int8 kernel is built without them",
                    os.strerror(refused))
        return load(extra_flags + WITHOUT_AMX)
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    pack, linear = library.pack_linear_weight_i8, library.linear_i8
    pack.argtypes, pack.restype = [pointer, pointer, pointer, i64, i64, i64], None
    linear.argtypes = [pointer, pointer, i64, pointer, pointer, pointer, pointer, i64, i64, i64, pointer, pointer,
                       ctypes.c_int]
    linear.restype = None
    return Int8Kernel(pack, linear, library.linear_i8_panel(), library.linear_i8_value_max(),
                      library.linear_i8_group())


def padded(in_features: int, extra_flags: tuple[str, ...] = ()) -> int:
    return load(extra_flags).padded(in_features)


def pack_weight(weight: torch.Tensor, extra_flags: tuple[str, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [out, in] int8 within +-value_max -> (packed [ceil(out / panel), padded in * panel] int8,
    compensation [out] int32) for the kernel load(extra_flags) builds."""
    kernel = load(extra_flags)
    out_features, in_features = weight.shape
    weight = weight.detach().contiguous()
    assert weight.dtype == torch.int8 and weight.device.type == "cpu", "int8 on the CPU only"
    assert int(weight.abs().max()) <= kernel.value_max, f"weights within +-{kernel.value_max} only"
    padded_in = kernel.padded(in_features)
    packed = torch.empty(-(-out_features // kernel.panel), padded_in * kernel.panel, dtype=torch.int8)
    compensation = torch.empty(out_features, dtype=torch.int32)
    kernel.pack(packed.data_ptr(), compensation.data_ptr(), weight.data_ptr(), out_features, in_features,
                padded_in)
    return packed, compensation


def linear(x: torch.Tensor, packed: torch.Tensor, compensation: torch.Tensor, weight_scale: torch.Tensor,
           bias: torch.Tensor | None, scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
           extra_flags: tuple[str, ...] = ()) -> torch.Tensor:
    """x [rows, in] float32 times the packed weight, scaled per channel by weight_scale [out] (+ bias) -> float32
    [rows, out], on torch's threads. scratch: (uint8 [rows, padded in], float32 [rows]) to hold x quantized and
    shifted by value_max + 1 (tests read it); by default fresh tensors."""
    kernel = load(extra_flags)
    x = x.contiguous()
    rows, in_features = x.shape
    out_features = compensation.shape[0]
    padded_in = kernel.padded(in_features)
    assert x.dtype == torch.float32 and packed.shape[1] == padded_in * kernel.panel
    values, token_scales = scratch or (torch.empty(rows, padded_in, dtype=torch.uint8), torch.empty(rows))
    out = torch.empty(rows, out_features)
    kernel.linear(out.data_ptr(), x.data_ptr(), rows, packed.data_ptr(), compensation.data_ptr(),
                  weight_scale.data_ptr(), None if bias is None else bias.data_ptr(), out_features, in_features,
                  padded_in, values.data_ptr(), token_scales.data_ptr(), torch.get_num_threads())
    return out
