"""glm_engine.host_allocator: with freed memory kept, the large activations of later steps reuse the pages of the
earlier ones instead of faulting fresh ones in (each process fresh: malloc's settings last for the process)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

# Eight "steps", each holding four 24 MiB tensors at once (as a prefill step's activations) and then freeing them;
# prints the page faults of each step. glibc's own heuristics sometimes keep such memory and sometimes give it back,
# depending on where small allocations land, so the control is deterministic instead: the same with malloc_trim
# after each step, which hands all free memory back.
TENSORS, TENSOR_FLOATS = 4, 6 * 2**20
STEP_FAULTS = f"""
import ctypes, resource, sys, torch
from glm_engine.host_allocator import keep_freed_memory
assert keep_freed_memory()
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts = []
for step in range(8):
    before = faults()
    activations = [torch.ones({TENSOR_FLOATS}) for _ in range({TENSORS})]
    del activations
    counts.append(faults() - before)
    if sys.argv[1] == "trim":
        ctypes.CDLL(None).malloc_trim(0)
print(*counts)
"""
STEP_PAGES = TENSORS * TENSOR_FLOATS * 4 // 4096


def step_faults(mode: str) -> list[int]:
    env = {name: value for name, value in os.environ.items() if name != "LD_PRELOAD"}  # glibc's malloc
    completed = subprocess.run([sys.executable, "-c", STEP_FAULTS, mode], capture_output=True, text=True,
                               timeout=120, env=env)
    assert completed.returncode == 0, completed.stderr
    return [int(count) for count in completed.stdout.split()]


def test_kept_memory_is_reused_without_page_faults():
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc here is not glibc's")
    # The check can fail: memory handed back is faulted in again at every step.
    assert all(count > STEP_PAGES // 2 for count in step_faults("trim"))
    # Kept, it is reused from the fourth step on (the second or the third may still fault one tensor's pages in:
    # a block freed between small allocations can be a little short for the next aligned one).
    assert sum(step_faults("keep")[3:]) < STEP_PAGES // 20
