"""What this CPU can do, from /proc/cpuinfo: the engine picks its int8 product and keys its compiled kernels by it."""

from __future__ import annotations

import functools


@functools.lru_cache
def cpu_flags() -> frozenset[str] | None:
    """The instruction-set flags of the first CPU, or None where /proc/cpuinfo does not list them."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        return None
    return None if flags is None else frozenset(flags)
