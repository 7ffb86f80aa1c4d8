"""Whether an engine fits in the memory its device has left, checked before it loads anything.

Two versions of a model run side by side during a rollout (docs/versions.md), each an engine of its own, so an
engine sizes itself by its own budget, never by the whole device, and one that cannot fit is refused at once with
what it needs and what there is, leaving the engines already running untouched.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from safetensors import safe_open

from .checkpoint import SCALE_SUFFIXES, UNUSED_SUFFIXES, safetensors_files

# Room kept free beside an engine's weights and KV cache: activations of a full prefill step, allocator slack.
RESERVE_BYTES = 256 * 2**20
GIB = 2**30


class InsufficientMemory(ValueError):
    """The engine would not fit; the message says how much it needs and how much there is."""


def weight_bytes(model_dir: str, dtype: torch.dtype, quantized: set[str] = frozenset(),
                 shape_of: Callable[[str, torch.Size], torch.Size] | None = None) -> int:
    """The checkpoint's weights once loaded in `dtype`, those named in `quantized` in one byte per value and a
    float32 scale per row (read from the file headers only; an FP8 checkpoint's own scales are not kept).
    shape_of: the shape a tensor is loaded in, from its stored one (one rank's part: Shard.split_shape)."""
    total = 0
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(SCALE_SUFFIXES + UNUSED_SUFFIXES):
                    continue
                shape = torch.Size(f.get_slice(name).get_shape())
                if shape_of is not None:
                    shape = shape_of(name, shape)
                total += shape.numel() + 4 * shape[0] if name in quantized else shape.numel() * dtype.itemsize
    return total


def available_bytes(device: torch.device) -> int:
    """Memory free for a new engine: on CUDA the device's free memory; on the CPU the kernel's MemAvailable, or
    less where a cgroup (a container's memory limit) allows less."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    available = int(fields["MemAvailable"].split()[0]) * 1024
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
        if limit != "max":
            available = min(available, int(limit) - used)
    except (OSError, ValueError):  # no cgroup v2 memory controller here
        pass
    return available


def check_fits(what: str, parts: dict[str, int], available: int, reserve: int = RESERVE_BYTES) -> None:
    """Raise InsufficientMemory unless the parts (name -> bytes) and `reserve` fit in `available`."""
    needed = sum(parts.values()) + reserve
    if needed > available:
        listed = " + ".join(f"{name} {size / GIB:.2f} GiB" for name, size in [*parts.items(), ("reserve", reserve)]
                            if size)
        raise InsufficientMemory(
            f"{what} needs {needed / GIB:.2f} GiB ({listed}) and "
            f"{available / GIB:.2f} GiB is free: lower kv_cache_memory_mb / gpu_memory_utilization / num_kv_blocks "
            "(in config.pbtxt, or for one version in its version.json), or unload a version first")

