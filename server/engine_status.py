"""What the loaded engine runs as, for /health and /metrics: its precision mode, how many batches fell back from
the fast precision to the exact one, and what the backend says of itself (``Backend.status``: on a GPU whether
cuBLAS could be loaded; without it every GEMM runs clefcore's own kernels)."""

from __future__ import annotations

from clefcore.engine import EngineStatus


def describe(status: EngineStatus) -> dict:
    return {"precision": status.mode, **status.backend, "precision_fallbacks": status.fallbacks}
