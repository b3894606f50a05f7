"""One answer to "is there a GPU?" for the test modules: ``HAVE_GPU`` and ``MARKS`` (the ``gpu`` marker plus a
clean skip without CuPy or a visible CUDA device). Import it after ``sys.path.insert(0, tests dir)``."""

from __future__ import annotations

import pytest


def _have_gpu() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: all mean "skip"
        return False


HAVE_GPU = _have_gpu()
MARKS = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device visible to CuPy")]
