"""CUDA backend: kernels in ``cuda/*.cu`` compiled by NVRTC (``compile``), driven by ``CudaOps`` (``ops``)."""

from .ops import CudaOps  # noqa: F401
