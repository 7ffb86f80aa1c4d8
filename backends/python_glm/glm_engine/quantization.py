"""Quantized linear layers: INT8 and FP8 weights per output channel, activations quantized per token at each step.

Both are symmetric: a weight row (an output channel) is scaled by its largest magnitude onto the integer range
(int8, +-127) or the float8_e4m3fn range (+-448); so is each token's activation row, when the layer runs. The
product is computed on the 8-bit values and scaled back by the token's and the channel's scales, so a token's
result never depends on the other tokens in the batch (one outlier token cannot cost another precision, and a
request gets the same tokens whoever it is batched with).

- int8: `torch._int_mm` (int8 x int8 -> int32; oneDNN's VNNI kernels on the CPU, cuBLASLt on CUDA). On the CPU
  with the other C kernels (layer_backend auto / cpu, float32), this package's cpu_int8_kernel instead, which
  quantizes, multiplies and rescales in one pass (8-bit with AVX-512 VNNI; with AVX2 alone, 7-bit weights and
  activations). On a CPU without an int8 dot-product instruction (VNNI or AMX: e.g. AVX2-only AMD EPYCs), `_int_mm`
  falls back to a plain loop (4 GFLOP/s measured, 25x slower than float32): with layer_backend torch the layer
  uses oneDNN's uint8 x int8 product there, with activations kept to 7 bits (int8_matmul_avx2).
- fp8: `torch._scaled_mm` on CUDA devices with FP8 tensor cores (compute capability 8.9 and up). Elsewhere it is
  emulated: the 8-bit values are widened to float32 and multiplied there, which gives the numbers FP8 gives (up to
  the order of the sums), not its speed; that is how its quality is measured on the CPU.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from . import cpu_int8_kernel
from .cpu_info import cpu_flags

INT8_MAX = 127.0
# Activations on CPUs without VNNI: AVX2's uint8 x int8 instruction adds pairs of products in 16 bits, which
# saturate unless the uint8 side keeps to 7 bits (fbgemm's reduce_range does the same).
INT7_MAX = 63.0
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# A row of zeros gets this largest magnitude instead of 0, so that quantizing it divides by something.
MIN_SCALE = 1e-12


@functools.lru_cache
def fp8_supported(device: torch.device) -> bool:
    """FP8 matmuls run natively only on CUDA devices of compute capability 8.9 (Ada) and up (Hopper, Blackwell)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def cpu_has_int8_dot_product() -> bool:
    """Whether this CPU has an int8 dot-product instruction (AVX512-VNNI, AVX-VNNI or AMX), which torch._int_mm's
    fast CPU path needs. Assumed where /proc/cpuinfo does not say."""
    flags = cpu_flags()
    return flags is None or bool({"avx512_vnni", "avx_vnni", "amx_int8"} & flags)


def int8_cpu_kernel(layer_kernels: str | None) -> str | None:
    """What runs int8 products on this CPU, given what runs the rest of the layers
    (model_runner.choose_layer_kernels): "cpu" (cpu_int8_kernel, with the C kernels, where its build has VNNI or the
    CPU has no int8 dot product at all), "onednn" (int8_matmul_avx2: no VNNI, the torch layers) or None
    (torch._int_mm)."""
    vnni = cpu_has_int8_dot_product()
    if layer_kernels == "cpu" and (not vnni or cpu_int8_kernel.load().value_max == INT8_MAX):
        return "cpu"
    return None if vnni else "onednn"


def resolve_method(wanted: str, checkpoint_method: str, device: torch.device) -> str:
    """What 'auto' means: the checkpoint's own precision where this device runs it natively, else none (float)."""
    if wanted != "auto":
        return wanted
    if checkpoint_method == "fp8" and fp8_supported(device):
        return "fp8"
    return "none"


def quantize_rows(x: torch.Tensor, method: str, top: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization of x [rows, cols]: (values int8 / float8_e4m3fn, scales float32 [rows, 1]),
    with x ~= values * scales; values within +-top (default: the type's range). Few operators, as this runs before
    every 8-bit product: at decode sizes each operator's fixed cost is what the layer spends beside the product."""
    top = top or (INT8_MAX if method == "int8" else FP8_MAX)
    x32 = x.float()
    # abs().amax(): vector_norm(ord=inf) gives the same and took 7-20x as long on the CPU
    scales = x32.abs().amax(dim=-1, keepdim=True).clamp_(min=MIN_SCALE).div_(top)
    scaled = x32 / scales
    if method == "int8":  # |scaled| <= 127 (up to rounding, which round() absorbs)
        return scaled.round_().to(torch.int8), scales
    # a value past 448 would become NaN in float8_e4m3fn, which has no infinity
    return scaled.clamp_(-top, top).to(FP8_DTYPE), scales


def int8_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """x [tokens, in] (float) times weight [out, in] (int8, scales [out]) -> float32 [tokens, out]."""
    values, scales = quantize_rows(x, "int8")
    rows = values.shape[0]
    if values.is_cuda and rows <= 16:  # cuBLASLt's int8 product wants more than 16 rows
        values = torch.cat([values, values.new_zeros(17 - rows, values.shape[1])])
    product = torch._int_mm(values, weight.t())[:rows]
    return torch.mul(product, scales).mul_(weight_scale)  # int32 times float32 is float32: no conversion pass


def int8_matmul_avx2(x: torch.Tensor, packed_weight: torch.Tensor, weight_scale: torch.Tensor,
                     zero_points: torch.Tensor) -> torch.Tensor:
    """int8_matmul for CPUs without VNNI: x [tokens, in] (float) times a weight packed by pack_int8_for_avx2 ->
    float32 [tokens, out]. Activations are quantized per token to 7 bits (+-63) and shifted by 64 into uint8, which
    oneDNN's AVX2 kernel multiplies without saturating: the integer sums are exact, then scaled by the weight's
    channel (inside oneDNN) and by the token."""
    values, scales = quantize_rows(x, "int8", INT7_MAX)
    shifted = values.add_(64).view(torch.uint8)  # 1 .. 127: fits int8, so the bits read as uint8 are the same
    product = torch.ops.onednn.qlinear_pointwise(shifted, 1.0, 64, packed_weight, weight_scale, zero_points, None,
                                                 1.0, 0, torch.float32, "none", [], "")
    return product.mul_(scales)


def pack_int8_for_avx2(weight: torch.Tensor) -> torch.Tensor:
    """An int8 weight [out, in] in oneDNN's layout for int8_matmul_avx2."""
    return torch.ops.onednn.qlinear_prepack(weight, None)


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """x [tokens, in] (float) times weight [out, in] (float8_e4m3fn, scales [out]) -> [tokens, out], in float32
    when emulated and in bfloat16 from the FP8 tensor cores (row-wise scales want a bfloat16 result)."""
    values, scales = quantize_rows(x, "fp8")
    if fp8_supported(x.device):
        return torch._scaled_mm(values, weight.t(), scale_a=scales, scale_b=weight_scale[None, :],
                                out_dtype=torch.bfloat16)
    return (values.float() @ weight.float().t()) * scales * weight_scale


class QuantizedLinear(nn.Module):
    """A Linear layer whose weight is stored in 8 bits with one float32 scale per output channel. Its state is
    `weight` (int8 or float8_e4m3fn [out, in]), `weight_scale` (float32 [out]) and `bias` (the model's dtype):
    the names compressed-tensors checkpoints use."""

    packed_weight: torch.Tensor | None = None
    kernel: str | None = None  # int8 on the CPU: "cpu" or "onednn" once packed (pack_for_cpu)

    def __init__(self, in_features: int, out_features: int, bias: bool, method: str, dtype: torch.dtype | None = None):
        super().__init__()
        if method not in ("int8", "fp8"):
            raise ValueError(f"QuantizedLinear is int8 or fp8, not {method!r}")
        self.in_features, self.out_features, self.method = in_features, out_features, method
        storage = torch.int8 if method == "int8" else FP8_DTYPE
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=storage))
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def pack_for_cpu(self, layer_kernels: str) -> None:
        """Hand an int8 weight to the CPU kernel that will run it (int8_cpu_kernel), in its layout, in place of the
        plain one: cpu_int8_kernel (float32 activations; the weight requantized to the build's range) or oneDNN's.
        With torch._int_mm, and for fp8, nothing changes."""
        if self.method != "int8":
            return
        self.kernel = int8_cpu_kernel(layer_kernels)
        if self.kernel == "cpu":
            values, self.weight_scale = requantize(self.weight, self.weight_scale, cpu_int8_kernel.load().value_max)
            self.packed_weight, self.compensation = cpu_int8_kernel.pack_weight(values)
        elif self.kernel == "onednn":
            self.packed_weight = pack_int8_for_avx2(self.weight)
            self.zero_points = torch.zeros(self.out_features, dtype=torch.long)
        if self.packed_weight is not None:
            self.weight = None  # the packed copy replaces it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, in_features] -> [tokens, out_features] in x's dtype."""
        if self.kernel == "cpu":  # adds the bias itself
            return cpu_int8_kernel.linear(x, self.packed_weight, self.compensation, self.weight_scale, self.bias)
        if self.kernel == "onednn":
            out = int8_matmul_avx2(x, self.packed_weight, self.weight_scale, self.zero_points)
        else:
            matmul = int8_matmul if self.method == "int8" else fp8_matmul
            out = matmul(x, self.weight, self.weight_scale)
        out = out.to(x.dtype)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.method}"


def quantize_weight(weight: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [out, in] as (8-bit values [out, in], float32 scales [out])."""
    values, scales = quantize_rows(weight, method)
    return values, scales.squeeze(-1)


def requantize(values: torch.Tensor, scales: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weights [out, in] (+-127, scales [out]) onto the range +-top: (values, scales); the same at 127.
    Rounding twice costs a little: on the trained demo model's weights, 7 bits this way err 1.14x as much (RMS) as 7
    bits from the float weights, and 2.3x as much as 8 bits."""
    if top == INT8_MAX:
        return values, scales
    ratio = top / INT8_MAX
    return (values.float() * ratio).round_().to(torch.int8), scales / ratio


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """An FP8 checkpoint's weight [out, in] times its scale, in float32. The scale is one number (per tensor),
    one per output channel ([out] or [out, 1]), or one per block of `block` = (rows, columns) ([ceil(out / rows),
    ceil(in / columns)]: GLM-5 / DeepSeek's weight_scale_inv)."""
    values, scale = weight.float(), scale.float()
    if block is not None:
        rows, columns = block
        expanded = scale.reshape(-(-values.shape[0] // rows), -1)
        expanded = expanded.repeat_interleave(rows, dim=0).repeat_interleave(columns, dim=1)
        return values * expanded[: values.shape[0], : values.shape[1]]
    if scale.numel() == 1:
        return values * scale.reshape(())
    if scale.numel() != values.shape[0]:
        raise ValueError(f"a scale of shape {list(scale.shape)} for a weight of shape {list(values.shape)} is "
                         "neither per tensor nor per output channel, and the checkpoint names no block size")
    return values * scale.reshape(-1, 1)
