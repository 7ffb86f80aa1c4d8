"""Keep the memory a CPU step frees for the next step, instead of handing it back to the kernel.

Memory handed back is faulted in anew by the next step, the kernel zeroing each page. A 2,048-token prefill step of
the bench model allocates tens of MiB of activations; kept, later steps reuse the pages, and the process keeps its
peak working set, which a server sizes for anyway (docs/performance.md).

- glibc's malloc serves a block of over 128 KiB (raised as large blocks are freed, to at most 32 MiB) with a fresh
  mmap and unmaps it when freed, and returns the free top of its heaps above a trim threshold: over the bench run
  offline that was 120,000 page faults and about a tenth of the time.
- jemalloc, which the launcher preloads into the server and its stubs, hands freed pages back gradually over 10 s,
  and blocks of 8 MiB or more (its "huge" arena) at once: behind Triton, the bench's prefill steps took twice as
  long as offline, where glibc's malloc kept them.
- Another malloc (tcmalloc) is left to its own policy.
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

# jemalloc's decay times, in ms, after which freed pages are handed back ("dirty": still mapped; "muzzy": marked
# reclaimable); -1 never. The arenas.* defaults apply to arenas made later, among them the huge arena, which jemalloc
# makes on the first block of 8 MiB or more and sets to purge at once unless the default is -1; the arenas that
# exist already are set one by one.
JEMALLOC_DECAYS = ("dirty_decay_ms", "muzzy_decay_ms")
NEVER = -1


def keep_freed_memory() -> str | None:
    """Tell this process's malloc to keep freed memory for reuse. Returns the malloc told ("jemalloc" or "glibc"),
    or None (nothing changed) where it is another one or refuses."""
    if platform.system() != "Linux":
        return None
    process = ctypes.CDLL(None)
    mallctl = getattr(process, "mallctl", None)  # jemalloc's, when it is preloaded
    if mallctl is not None:
        return "jemalloc" if _keep_in_jemalloc(mallctl) else _refused()
    if "malloc" in os.environ.get("LD_PRELOAD", "") or platform.libc_ver()[0] != "glibc":
        return None
    mallopt = process.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    kept = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return "glibc" if kept else _refused()


def _keep_in_jemalloc(mallctl) -> bool:
    mallctl.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    mallctl.restype = ctypes.c_int
    never = ctypes.c_ssize_t(NEVER)

    def set_never(name: str) -> bool:
        return mallctl(name.encode(), None, None, ctypes.byref(never), ctypes.sizeof(never)) == 0

    narenas, size = ctypes.c_uint(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_uint))
    if mallctl(b"arenas.narenas", ctypes.byref(narenas), ctypes.byref(size), None, 0) != 0:
        return False
    if not all(set_never(f"arenas.{decay}") for decay in JEMALLOC_DECAYS):
        return False
    # An arena not made yet refuses (and will take the defaults above when it is).
    for arena in range(narenas.value):
        for decay in JEMALLOC_DECAYS:
            set_never(f"arena.{arena}.{decay}")
    return True


def _refused() -> None:
    log.warning("malloc refused to keep freed memory: CPU steps will fault their activations in anew")
    return None
