"""One answer to "is there a GPU?" for the test modules: ``HAVE_GPU``, ``HAVE_FP8`` (fp8 tensor cores, compute
capability 8.9+, which the split8 precision needs), ``HAVE_MMA`` (compute capability 8.0+, where gemm_mma.cu runs in
native code), ``HAVE_CUBLAS`` / ``NEEDS_CUBLAS`` and ``MARKS`` (the ``gpu`` marker plus a clean skip without
CuPy or a visible CUDA device). Tests import it by name: conftest.py puts this folder on sys.path."""

from __future__ import annotations

import zlib

import numpy as np
import pytest


def _have_gpu() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: all mean "skip"
        return False


def _cc() -> int:
    import cupy
    return int(cupy.cuda.Device(0).compute_capability)           # a string such as "90" or "100"


def _have_cublas() -> bool:
    from clefcore.backends.cuda import cublas
    return cublas.missing() is None


HAVE_GPU = _have_gpu()
HAVE_FP8 = HAVE_GPU and _cc() >= 89
HAVE_MMA = HAVE_GPU and _cc() >= 80
# False where cuBLAS cannot be loaded (an image without it, or a run under tests/no_cublas/): the engine then runs
# its own GEMM kernels, and the tests that pin cuBLAS skip
HAVE_CUBLAS = HAVE_GPU and _have_cublas()
NEEDS_CUBLAS = pytest.mark.skipif(not HAVE_CUBLAS, reason="cuBLAS cannot be loaded here")
MARKS = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device visible to CuPy")]


def reseed(rng: np.random.Generator, request) -> None:
    """Reseed a module's generator from the test's id: every run of one test draws the same inputs, whatever ran
    before it, and a failure reruns as it failed (the seed is printed)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    print(f"seed {seed} for {request.node.nodeid}")
    rng.bit_generator.state = np.random.default_rng(seed).bit_generator.state
