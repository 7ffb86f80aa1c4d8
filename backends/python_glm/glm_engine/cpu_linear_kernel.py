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
PANEL = 16  # output channels a panel: as in the C source


@functools.cache
def load() -> tuple:
    """The kernel's (pack, linear) C functions, built on first use. Raises KernelUnavailable."""
    library = load_library(SOURCE)
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    pack, linear = library.pack_linear_weight_f32, library.linear_f32
    pack.argtypes, pack.restype = [pointer, pointer, i64, i64], None
    linear.argtypes, linear.restype = [pointer, pointer, i64, pointer, pointer, i64, i64, ctypes.c_int], None
    return pack, linear


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] float32 -> its packed copy [ceil(out / PANEL), in, PANEL]."""
    out_features, in_features = weight.shape
    weight = weight.detach().contiguous()
    assert weight.dtype == torch.float32 and weight.device.type == "cpu", "float32 on the CPU only"
    packed = torch.empty(-(-out_features // PANEL), in_features, PANEL)
    load()[0](packed.data_ptr(), weight.data_ptr(), out_features, in_features)
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [rows, in] float32 times the packed weight (+ bias) -> [rows, out_features], on torch's threads."""
    x = x.contiguous()
    rows, in_features = x.shape
    assert x.dtype == torch.float32 and packed.shape[1] == in_features
    out = torch.empty(rows, out_features)
    load()[1](out.data_ptr(), x.data_ptr(), rows, packed.data_ptr(), None if bias is None else bias.data_ptr(),
              out_features, in_features, torch.get_num_threads())
    return out
