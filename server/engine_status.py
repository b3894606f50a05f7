"""What the loaded engine runs as, for /health and /metrics: the precision mode, whether cuBLAS could be
loaded (without it every GEMM runs clefcore's own kernels), and how many batches fell back from the fast
precision to the exact one. Read with getattr: the CPU engine has no cuBLAS to speak of, and an engine
without one of these attributes simply leaves it out."""

from __future__ import annotations

from typing import Any


def describe(engine: Any) -> dict:
    info: dict = {}
    precision = getattr(engine, "precision", None)
    if precision is not None:
        info["precision"] = str(precision)
    ops = getattr(engine, "ops", None)
    if ops is not None and hasattr(ops, "cublas_missing"):
        missing = ops.cublas_missing
        info["cublas"] = missing is None
        if missing is not None:
            info["cublas_missing"] = str(missing)
    if hasattr(engine, "fallbacks"):
        info["precision_fallbacks"] = int(engine.fallbacks or 0)
    return info
