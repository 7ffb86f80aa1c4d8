"""glm_engine.host_allocator: with freed memory kept, a step's second large activation reuses the pages of the
first instead of faulting fresh ones in (each process fresh: malloc's settings last for the process)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

# Allocates and frees a 16 MiB tensor (as a prefill step's activations), then prints the page faults a second one
# costs.
SECOND_ALLOCATION_FAULTS = """
import resource, sys, torch
from glm_engine.host_allocator import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.ones(2**22)
before = faults()
torch.ones(2**22)
print(faults() - before)
"""


def second_allocation_faults(mode: str) -> int:
    env = {name: value for name, value in os.environ.items() if name != "LD_PRELOAD"}  # glibc's malloc
    completed = subprocess.run([sys.executable, "-c", SECOND_ALLOCATION_FAULTS, mode], capture_output=True,
                               text=True, timeout=120, env=env)
    assert completed.returncode == 0, completed.stderr
    return int(completed.stdout)


def test_kept_memory_is_reused_without_page_faults():
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc here is not glibc's")
    pages = 2**24 // 4096
    assert second_allocation_faults("default") > pages // 2  # the check can fail: by default the pages are new
    assert second_allocation_faults("keep") < pages // 20
