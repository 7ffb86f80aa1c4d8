"""Quantized linear layers: INT8 and FP8 weights per output channel, activations quantized per token at each step.

Both are symmetric: a weight row (an output channel) is scaled by its largest magnitude onto the integer range
(int8, +-127) or the float8_e4m3fn range (+-448); so is each token's activation row, when the layer runs. The
product is computed on the 8-bit values and scaled back by the token's and the channel's scales, so a token's
result never depends on the other tokens in the batch (one outlier token cannot cost another precision, and a
request gets the same tokens whoever it is batched with).

- int8: `torch._int_mm` (int8 x int8 -> int32; oneDNN's VNNI kernels on the CPU, cuBLASLt on CUDA).
- fp8: `torch._scaled_mm` on CUDA devices with FP8 tensor cores (compute capability 8.9 and up). Elsewhere it is
  emulated: the 8-bit values are widened to float32 and multiplied there, which gives the numbers FP8 gives (up to
  the order of the sums), not its speed; that is how its quality is measured on the CPU.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

INT8_MAX = 127.0
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# A row of zeros gets this largest magnitude instead of 0, so that quantizing it divides by something.
MIN_SCALE = 1e-12


@functools.lru_cache
def fp8_supported(device: torch.device) -> bool:
    """FP8 matmuls run natively only on CUDA devices of compute capability 8.9 (Ada) and up (Hopper, Blackwell)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def resolve_method(wanted: str, checkpoint_method: str, device: torch.device) -> str:
    """What 'auto' means: the checkpoint's own precision where this device runs it natively, else none (float)."""
    if wanted != "auto":
        return wanted
    if checkpoint_method == "fp8" and fp8_supported(device):
        return "fp8"
    return "none"


def quantize_rows(x: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization of x [rows, cols]: (values int8 / float8_e4m3fn, scales float32 [rows, 1]),
    with x ~= values * scales. Few operators, as this runs before every 8-bit product: at decode sizes each
    operator's fixed cost is what the layer spends beside the product."""
    top = INT8_MAX if method == "int8" else FP8_MAX
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

    def __init__(self, in_features: int, out_features: int, bias: bool, method: str, dtype: torch.dtype | None = None):
        super().__init__()
        if method not in ("int8", "fp8"):
            raise ValueError(f"QuantizedLinear is int8 or fp8, not {method!r}")
        self.in_features, self.out_features, self.method = in_features, out_features, method
        storage = torch.int8 if method == "int8" else FP8_DTYPE
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=storage))
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens, in_features] -> [tokens, out_features] in x's dtype."""
        matmul = int8_matmul if self.method == "int8" else fp8_matmul
        out = matmul(x, self.weight, self.weight_scale).to(x.dtype)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.method}"


def quantize_weight(weight: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [out, in] as (8-bit values [out, in], float32 scales [out])."""
    values, scales = quantize_rows(weight, method)
    return values, scales.squeeze(-1)


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
