"""Building this package's C kernels (cpu_decode_kernel.c, cpu_prefill_kernel.c, cpu_linear_kernel.c,
cpu_elementwise_kernel.c, cpu_int8_kernel.c) for the CPU they run on.

Each is compiled on first use with the system's C compiler (`CC`, else `cc`) for this CPU (-march=native), in well
under a second, into a cache directory (`GLM_KERNEL_CACHE`, else ~/.cache/open-autoglm, else the temporary
directory) under a name that hashes the source, the compiler, its flags and the CPU's, then loaded with ctypes.
`GLM_KERNEL_FLAGS` adds compiler flags to every build (`-mno-amx-tile -mno-amx-int8`: the int8 kernel without AMX,
to compare the two; `-mno-avx512f`: the AVX2 builds). Where a kernel cannot be built, KernelUnavailable says why,
and the engine keeps its torch / oneDNN path (backend auto) or refuses to start (a backend asked for by name). No
torch headers: plain C and OpenMP, whose runtime is the one torch has already loaded.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from .cpu_info import cpu_flags

CACHE_ENV = "GLM_KERNEL_CACHE"
FLAGS_ENV = "GLM_KERNEL_FLAGS"
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


@functools.cache
def _compiler_version(compiler: str) -> str:
    """`cc --version`, once a process: every kernel's cache key holds it."""
    return subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout


def build(source: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """The compiled shared object of a C source (in this package), compiling it unless the cache has it. Several
    processes may build at once: each writes its own temporary file and renames it into place. extra_flags follow
    the usual ones and GLM_KERNEL_FLAGS' (tests build a kernel for a narrower instruction set than this CPU's:
    -mno-avx512f). The cache key covers the headers beside the source (cpu_tiles.h), which a source may include."""
    compiler = _compiler()
    compile_flags = [*COMPILE_FLAGS, *shlex.split(os.environ.get(FLAGS_ENV, "")), *extra_flags]
    headers = [header.read_text() for header in sorted(source.parent.glob("*.h"))]
    key = hashlib.sha256("\0".join([
        source.read_text(), *headers, compiler, _compiler_version(compiler), " ".join(compile_flags + LINK_FLAGS),
        platform.machine(), " ".join(sorted(cpu_flags() or ())),
    ]).encode()).hexdigest()[:16]
    errors = []
    for directory in _cache_dirs():
        target = directory / f"{source.stem}-{key}.so"
        if target.exists():
            return target
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=directory) as scratch:
                obj, lib = Path(scratch) / "kernel.o", Path(scratch) / "kernel.so"
                _run([compiler, *compile_flags, "-c", str(source), "-o", str(obj)])
                _run([compiler, str(obj), "-o", str(lib), *LINK_FLAGS])
                os.replace(lib, target)
            return target
        except OSError as exc:  # not writable: try the next directory
            errors.append(f"{directory}: {exc.strerror or exc}")
    raise KernelUnavailable(f"no writable cache directory for the compiled kernel ({'; '.join(errors)}); "
                            f"set {CACHE_ENV}")


def load_library(source: Path, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The compiled library of a C source, built unless cached. Raises KernelUnavailable."""
    if platform.system() != "Linux":
        raise KernelUnavailable(f"built for Linux only, not {platform.system()}")
    try:
        return ctypes.CDLL(str(build(source, extra_flags)))
    except OSError as exc:
        raise KernelUnavailable(f"the compiled kernel does not load: {exc}") from exc
