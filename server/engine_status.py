"""What the loaded engine runs as, for /health and /metrics: its precision mode, how many batches fell back from
the fast precision to the exact one, and what the backend says of itself (``Backend.status``: on a GPU whether
cuBLAS could be loaded; without it every GEMM runs clefcore's own kernels)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from clefcore.engine import Engine


def describe(engine: Engine) -> dict:
    return {"precision": engine.mode, **engine.ops.status(), "precision_fallbacks": int(engine.fallbacks)}
