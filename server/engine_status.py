"""What the loaded engine runs as, for /health and /metrics: its precision mode, how many batches fell back from
the fast precision to the exact one, and what the backend says of itself (``Backend.status``: on a GPU whether
cuBLAS could be loaded; without it every GEMM runs clefcore's own kernels)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from clefcore.engine import EngineStatus


def describe(status: EngineStatus) -> dict:
    return {"precision": status.mode, **status.backend, "precision_fallbacks": status.fallbacks}


def combined(statuses: Sequence[EngineStatus], device: str | None = None) -> EngineStatus:
    """One status for the engines of a Service's devices, all loaded from one checkpoint with one set of options:
    the first one's model, mode, images and backend; fallbacks and device memory summed over them; the device
    named ``device`` (the devices as served: each device process sees its own GPU as cuda:0; None: the first
    one's). One engine: its own status."""
    first = statuses[0]
    if len(statuses) == 1:
        return first
    return replace(first, device=device or first.device, fallbacks=sum(s.fallbacks for s in statuses),
                   memory_in_use=sum(s.memory_in_use for s in statuses))
