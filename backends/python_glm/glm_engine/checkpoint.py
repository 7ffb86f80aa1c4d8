"""Reading a Hugging Face GLM / GLM-4 checkpoint directory: its weights, single-file or sharded."""

from __future__ import annotations

import glob
import json
import os

import torch
from safetensors import safe_open

from .config import CheckpointError


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


def load_state_dict(model_dir: str, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    state = {}
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                state[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    return state
