"""Keep the memory a CPU step frees for the next step, instead of handing it back to the kernel.

glibc's malloc serves a block of over 128 KiB (raised as large blocks are freed, to at most 32 MiB) with a fresh
mmap and unmaps it when freed, and returns the free top of its heaps above a trim threshold: every step then
faults its activations' pages in anew and the kernel zeroes each one. A 2,048-token prefill step of the bench
model allocates tens of MiB that way; over the bench run that was 120,000 page faults and about a tenth of the
time (docs/performance.md). With large blocks kept in the heaps and the heaps never trimmed, later steps reuse the
pages: the process keeps its peak working set, which a server sizes for anyway.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)

# mallopt's parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): only blocks larger go to mmap.
MMAP_THRESHOLD_MAX = 32 * 2**20
# mallopt takes an int: INT_MAX, 2 GiB of free heap kept before any is returned.
TRIM_THRESHOLD = 2**31 - 1


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory for reuse; False (and nothing changed) where malloc is not
    glibc's (another one preloaded) or refuses."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if "malloc" in os.environ.get("LD_PRELOAD", ""):  # jemalloc or tcmalloc (the launcher's): their own policy
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    kept = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not kept:
        log.warning("malloc refused to keep freed memory: CPU steps will fault their activations in anew")
    return kept
