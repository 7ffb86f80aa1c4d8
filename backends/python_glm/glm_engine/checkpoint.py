"""Reading a Hugging Face GLM / GLM-4 checkpoint directory: its weights, single-file or sharded, float or FP8.

FP8 checkpoints come in the two formats of GLM's official FP8 releases, both read from config.json's
`quantization_config`:
- compressed-tensors (`quant_method: compressed-tensors`, `format: float-quantized`; GLM-4.5 / GLM-4.6-FP8):
  `X.weight` in float8_e4m3fn with `X.weight_scale` per tensor, per output channel, or per block
  (`strategy: block`, `block_structure`);
- block-wise FP8 (`quant_method: fp8`, `weight_block_size: [128, 128]`; GLM-5-FP8, DeepSeek's format):
  `X.weight` in float8_e4m3fn with `X.weight_scale_inv`, one scale per 128 x 128 block (multiplied, despite its
  name).
Every FP8 weight is dequantized as it is read; the engine's own `quantization` then decides how it is stored
(FP8 again per channel, INT8, or the model's float dtype). Static activation scales (`input_scale`) and KV-cache
scales are not used: activations are always quantized per token, and the KV cache keeps the model's dtype.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from safetensors import safe_open

from .config import CheckpointError
from .quantization import FP8_DTYPE, dequantize_fp8, quantize_weight

# Tensors of FP8 checkpoints read together with their weight (the scales), or not at all.
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv")
UNUSED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale")


@dataclass(frozen=True)
class StoredPrecision:
    """How a checkpoint's Linear weights are stored: float ("none"), or "fp8" with scales named `scale_suffix`,
    per block of `block` = (rows, columns) where the scales are block-wise."""

    method: str = "none"
    scale_suffix: str = ""
    block: tuple[int, int] | None = None


def stored_precision(model_dir: str) -> StoredPrecision:
    """Read config.json's quantization_config; a format this engine cannot read is a CheckpointError naming it."""
    with open(os.path.join(model_dir, "config.json")) as f:
        quant = json.load(f).get("quantization_config")
    if not quant:
        return StoredPrecision()
    method = quant.get("quant_method")
    if method == "fp8":
        if quant.get("fmt", "e4m3") != "e4m3":
            raise CheckpointError(f"FP8 checkpoint format {quant.get('fmt')!r} is not supported (only e4m3)")
        block = quant.get("weight_block_size")
        return StoredPrecision("fp8", ".weight_scale_inv", tuple(block) if block else None)
    if method == "compressed-tensors":
        if quant.get("format") not in ("float-quantized", "naive-quantized"):
            raise CheckpointError(f"compressed-tensors format {quant.get('format')!r} is not supported; this engine "
                                  "reads FP8 weights (format float-quantized)")
        blocks = set()
        for name, group in (quant.get("config_groups") or {}).items():
            weights = group.get("weights") or {}
            if weights.get("type") != "float" or weights.get("num_bits") != 8:
                raise CheckpointError(f"compressed-tensors group {name!r} stores {weights.get('num_bits')}-bit "
                                      f"{weights.get('type')} weights; this engine reads 8-bit float (FP8) weights")
            if weights.get("strategy") == "block":
                blocks.add(tuple(weights.get("block_structure") or (128, 128)))
        if len(blocks) > 1:
            raise CheckpointError(f"compressed-tensors groups use different block sizes {sorted(blocks)}")
        return StoredPrecision("fp8", ".weight_scale", blocks.pop() if blocks else None)
    raise CheckpointError(f"quantization_config quant_method {method!r} is not supported; this engine reads float "
                          "checkpoints and FP8 ones (compressed-tensors float-quantized, or fp8 with block scales)")


def safetensors_files(model_dir: str) -> list[str]:
    """The weight files, in the order the shard index names them."""
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [name for name in files if not os.path.isfile(os.path.join(model_dir, name))]
        if missing:
            raise CheckpointError(f"{model_dir!r}: shards named in model.safetensors.index.json are missing: {missing}")
        return [os.path.join(model_dir, name) for name in files]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise CheckpointError(f"{model_dir!r} holds no *.safetensors weights (pytorch_model.bin is not supported)")
    return files


def read_tensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, float tensor on the CPU) for each weight the model has, FP8 weights dequantized with their scales
    (which may lie in another shard) to float32; other tensors as stored."""
    stored = stored_precision(model_dir)
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(path, framework="pt", device="cpu"))
                   for path in safetensors_files(model_dir)]
        where = {name: handle for handle in handles for name in handle.keys()}
        for name, handle in where.items():
            if name.endswith(SCALE_SUFFIXES + UNUSED_SUFFIXES):
                continue
            tensor = handle.get_tensor(name)
            if tensor.dtype == FP8_DTYPE:
                scale_name = name.removesuffix(".weight") + stored.scale_suffix
                if stored.method != "fp8" or scale_name not in where:
                    raise CheckpointError(f"{name!r} is stored in FP8 without its scale {scale_name!r} "
                                          "(config.json's quantization_config says how the weights are stored)")
                try:
                    tensor = dequantize_fp8(tensor, where[scale_name].get_tensor(scale_name), stored.block)
                except ValueError as error:
                    raise CheckpointError(f"{name!r}: {error}") from None
            yield name, tensor


def place_tensors(tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, device: torch.device,
                  quantize: set[str] = frozenset(), method: str = "none") -> dict[str, torch.Tensor]:
    """The tensors on `device` in `dtype`, but those named in `quantize`, which are stored as `method` (int8 / fp8:
    8-bit `X.weight` and float32 `X.weight_scale`). Each is quantized as it comes, on the device, so a float copy
    of the whole model never exists at once."""
    state = {}
    for name, tensor in tensors:
        if name in quantize:
            values, scales = quantize_weight(tensor.to(device), method)
            state[name], state[name.removesuffix(".weight") + ".weight_scale"] = values, scales
        else:
            state[name] = tensor.to(device=device, dtype=dtype)
    return state


def load_state_dict(model_dir: str, dtype: torch.dtype, device: torch.device, quantize: set[str] = frozenset(),
                    method: str = "none", split: Callable[[str, torch.Tensor], torch.Tensor] | None = None
                    ) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, placed by place_tensors; with `split` (tensor parallelism: Shard.split), only the
    part of each that this rank holds, cut before it is quantized or moved to the device."""
    tensors = read_tensors(model_dir)
    if split is not None:
        tensors = ((name, split(name, tensor)) for name, tensor in tensors)
    return place_tensors(tensors, dtype, device, quantize, method)
