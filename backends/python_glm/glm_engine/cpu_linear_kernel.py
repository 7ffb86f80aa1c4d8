"""Float32 linear layers on the CPU in C (cpu_linear_kernel.c), the weight packed once at load into panels that a
product reads front to back.

oneDNN, which the engine used before, waits on memory in the small products of decode steps (a few dozen rows
against weights far larger than the caches): side by side here it ran them 1.1-1.6x slower than this kernel, and
prefill-sized ones no faster (docs/performance.md). Compiled on first use for this CPU (c_kernels.py); where it
cannot be built, load() raises KernelUnavailable saying why and the engine keeps oneDNN (layer_backend auto) or
refuses to start (layer_backend cpu).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .c_kernels import load_library

SOURCE = Path(__file__).with_suffix(".c")
@functools.cache
def load(extra_flags: tuple[str, ...] = ()) -> tuple:
    """The kernel's (pack, linear) C functions and its panel width (output channels a panel: 32 with AVX-512, else
    16), built on first use (extra_flags: c_kernels.build). Raises KernelUnavailable."""
    library = load_library(SOURCE, extra_flags)
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    pack, linear = library.pack_linear_weight_f32, library.linear_f32
    pack.argtypes, pack.restype = [pointer, pointer, i64, i64], None
    linear.argtypes, linear.restype = [pointer, pointer, i64, pointer, pointer, i64, i64, ctypes.c_int], None
    library.linear_f32_panel.restype = ctypes.c_int
    return pack, linear, library.linear_f32_panel()


def pack_weight(weight: torch.Tensor, extra_flags: tuple[str, ...] = ()) -> torch.Tensor:
    """weight [out, in] float32 -> its packed copy [ceil(out / panel), in, panel] for the kernel load(extra_flags)
    builds."""
    out_features, in_features = weight.shape
    weight = weight.detach().contiguous()
    assert weight.dtype == torch.float32 and weight.device.type == "cpu", "float32 on the CPU only"
    pack, _, panel = load(extra_flags)
    packed = torch.empty(-(-out_features // panel), in_features, panel)
    pack(packed.data_ptr(), weight.data_ptr(), out_features, in_features)
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
           extra_flags: tuple[str, ...] = ()) -> torch.Tensor:
    """x [rows, in] float32 times the packed weight (+ bias) -> [rows, out_features], on torch's threads."""
    x = x.contiguous()
    rows, in_features = x.shape
    assert x.dtype == torch.float32 and packed.shape[1] == in_features
    out = torch.empty(rows, out_features)
    load(extra_flags)[1](out.data_ptr(), x.data_ptr(), rows, packed.data_ptr(),
                         None if bias is None else bias.data_ptr(), out_features, in_features, torch.get_num_threads())
    return out
