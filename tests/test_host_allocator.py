"""glm_engine.host_allocator: with freed memory kept, the large activations of later steps reuse the pages of the
earlier ones instead of faulting fresh ones in (each process fresh: malloc's settings last for the process), with
glibc's malloc and with jemalloc preloaded (as the launcher runs the server)."""

from __future__ import annotations

import glob
import os
import platform
import subprocess
import sys

import pytest

# Ten "steps", each holding four 24 MiB tensors at once (as a prefill step's activations) and then freeing them;
# prints the page faults of each step. argv[1]: "keep" (memory kept), "trim" (kept, but glibc's malloc_trim after
# each step hands all free memory back: glibc's own heuristics sometimes keep such memory and sometimes give it
# back, so this control is deterministic) or "default" (malloc's own policy). argv[2]: the malloc expected.
TENSORS, TENSOR_FLOATS = 4, 6 * 2**20
STEP_FAULTS = f"""
import ctypes, resource, sys, torch
from glm_engine.host_allocator import keep_freed_memory
if sys.argv[1] != "default":
    assert keep_freed_memory() == sys.argv[2]
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts = []
for step in range(10):
    before = faults()
    activations = [torch.ones({TENSOR_FLOATS}) for _ in range({TENSORS})]
    del activations
    counts.append(faults() - before)
    if sys.argv[1] == "trim":
        ctypes.CDLL(None).malloc_trim(0)
print(*counts)
"""
STEP_PAGES = TENSORS * TENSOR_FLOATS * 4 // 4096
JEMALLOC = sorted(glob.glob("/usr/lib/*/libjemalloc.so.2"))


def step_faults(mode: str, preload: str | None = None) -> list[int]:
    env = {name: value for name, value in os.environ.items() if name not in ("LD_PRELOAD", "MALLOC_CONF")}
    if preload:
        env["LD_PRELOAD"] = preload
    completed = subprocess.run([sys.executable, "-c", STEP_FAULTS, mode, "jemalloc" if preload else "glibc"],
                               capture_output=True, text=True, timeout=120, env=env)
    assert completed.returncode == 0, completed.stderr
    return [int(count) for count in completed.stdout.split()]


def test_kept_memory_is_reused_without_page_faults():
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc here is not glibc's")
    # The check can fail: memory handed back is faulted in again at every step.
    assert all(count > STEP_PAGES // 2 for count in step_faults("trim"))
    # Kept, it is reused once glibc's heap has settled: the second, third or fourth step may still fault in some
    # tensors' pages (a block freed between small allocations can be a little short for the next aligned one; how
    # often depends on what the process allocated before, e.g. whether the engine's modules are imported).
    assert sum(step_faults("keep")[5:]) < STEP_PAGES // 20


@pytest.mark.skipif(not JEMALLOC, reason="Debian's libjemalloc2 is not installed (scripts/setup_env.sh installs it)")
def test_jemalloc_keeps_freed_memory_when_told():
    # Left to itself, jemalloc hands blocks of 8 MiB or more back at once: every step faults them in again.
    assert all(count > STEP_PAGES // 2 for count in step_faults("default", JEMALLOC[0]))
    # Told to keep them, it reuses the first step's pages from the second step on.
    assert sum(step_faults("keep", JEMALLOC[0])[1:]) < STEP_PAGES // 20
