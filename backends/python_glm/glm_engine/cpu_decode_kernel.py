"""Paged-attention decode on the CPU in C (cpu_decode_kernel.c): keys and values read from their blocks in place.

The torch path gathers every decoding sequence's blocks into one padded tensor before SDPA reads them: the KV cache
is copied once a layer a step. This kernel reads the blocks where they are, so a decode step's attention touches
each key and value once. It has the signature of the Triton-language kernel (paged_decode_kernel.py), which covers
CUDA; there is no Triton backend for the CPU.

Compiled on first use with the system's C compiler (`CC`, else `cc`) for this CPU (-march=native), in about a second,
into a cache directory (`GLM_KERNEL_CACHE`, else ~/.cache/open-autoglm, else the temporary directory) under a name
that hashes the source, the compiler and the CPU's flags, then loaded with ctypes. Where it cannot be built,
load() raises KernelUnavailable saying why, and the engine keeps the torch path (attention_backend auto) or refuses
to start (attention_backend cpu). float32 only.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from .cpu_info import cpu_flags

SOURCE = Path(__file__).with_suffix(".c")
CACHE_ENV = "GLM_KERNEL_CACHE"
# -ffast-math when compiling only: linking a shared object with it would set flush-to-zero for the whole process.
COMPILE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fPIC"]
LINK_FLAGS = ["-shared", "-fopenmp", "-lm"]


class KernelUnavailable(RuntimeError):
    """The C kernel cannot be built or loaded here; the message says why."""


def _compiler() -> str:
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise KernelUnavailable(f"no C compiler: {compiler!r} is not on PATH (install gcc, or set CC)")
    return compiler


def _cache_dirs() -> list[Path]:
    if configured := os.environ.get(CACHE_ENV):
        return [Path(configured)]
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return [home / "open-autoglm", Path(tempfile.gettempdir()) / f"open-autoglm-{os.getuid()}"]


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise KernelUnavailable(f"{Path(command[0]).name} failed (exit status {result.returncode}): "
                                f"{result.stderr.strip()[-500:]}")


def build() -> Path:
    """The compiled kernel's path, compiling it unless the cache has it. Several processes may build at once: each
    writes its own temporary file and renames it into place."""
    compiler = _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([
        SOURCE.read_text(), compiler, version, " ".join(COMPILE_FLAGS + LINK_FLAGS), platform.machine(),
        " ".join(sorted(cpu_flags() or ())),
    ]).encode()).hexdigest()[:16]
    errors = []
    for directory in _cache_dirs():
        target = directory / f"cpu_decode_kernel-{key}.so"
        if target.exists():
            return target
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=directory) as scratch:
                obj, lib = Path(scratch) / "kernel.o", Path(scratch) / "kernel.so"
                _run([compiler, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", str(obj)])
                _run([compiler, str(obj), "-o", str(lib), *LINK_FLAGS])
                os.replace(lib, target)
            return target
        except OSError as exc:  # not writable: try the next directory
            errors.append(f"{directory}: {exc.strerror or exc}")
    raise KernelUnavailable(f"no writable cache directory for the compiled kernel ({'; '.join(errors)}); "
                            f"set {CACHE_ENV}")


@functools.cache
def load():
    """The kernel's C function, built on first use. Raises KernelUnavailable."""
    if platform.system() != "Linux":
        raise KernelUnavailable(f"built for Linux only, not {platform.system()}")
    try:
        function = ctypes.CDLL(str(build())).paged_decode_attention_f32
    except OSError as exc:
        raise KernelUnavailable(f"the compiled kernel does not load: {exc}") from exc
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    function.argtypes = [pointer, pointer, i64, i64, pointer, pointer, pointer, i64, pointer,
                         i64, i64, i64, i64, i64, ctypes.c_float, i64, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [seqs, heads, head_dim] float32, one token per sequence; caches: [blocks, block_size, kv_heads, head_dim];
    block_tables: [seqs, max_blocks]; context_lens: [seqs] (the query token included). Returns [seqs, heads,
    head_dim]. On the threads torch uses (torch.get_num_threads())."""
    num_seqs, num_heads, head_dim = q.shape
    if q.stride(2) != 1:
        q = q.contiguous()
    assert q.dtype == k_cache.dtype == v_cache.dtype == torch.float32, "float32 only"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    block_tables = block_tables.to(torch.int64).contiguous()
    context_lens = context_lens.to(torch.int64).contiguous()
    out = torch.empty(num_seqs, num_heads, head_dim)
    max_context_len = int(context_lens.max()) if num_seqs else 0
    failed = load()(
        out.data_ptr(), q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(),
        num_seqs, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], scale, max_context_len,
        torch.get_num_threads())
    if failed:
        raise MemoryError(f"the CPU decode kernel could not allocate its scores ({max_context_len} tokens)")
    return out
