"""What the loaded engine runs as, for /health and /metrics: the precision mode, whether cuBLAS could be
loaded (without it every GEMM runs clefcore's own kernels; the CPU has no cuBLAS to speak of), and how many
batches fell back from the fast precision to the exact one."""

from __future__ import annotations

from clefcore.engine import EngineStatus


def describe(status: EngineStatus) -> dict:
    info: dict = {"precision": status.precision}
    if status.gpu:
        info["cublas"] = status.cublas_missing is None
        if status.cublas_missing is not None:
            info["cublas_missing"] = status.cublas_missing
    info["precision_fallbacks"] = status.fallbacks
    return info
