"""The C kernels the tests need, or a skip that says why they cannot run here."""

from __future__ import annotations

import pytest

from glm_engine import cpu_int8_kernel
from glm_engine.c_kernels import KernelUnavailable


def int8_kernel_or_skip(extra_flags: tuple[str, ...] = ()) -> cpu_int8_kernel.Int8Kernel:
    """cpu_int8_kernel built with these extra compiler flags; the test is skipped where it cannot be built."""
    try:
        return cpu_int8_kernel.load(extra_flags)
    except KernelUnavailable as exc:
        pytest.skip(f"the int8 kernel cannot run here: {exc}")
