"""Which GPU a spawned process sees: the one device it serves, as cuda:0.

Spawn copies ``os.environ`` when the process starts, so CUDA_VISIBLE_DEVICES set around the start is what the
child sees, and every CUDA call in it, on any thread, lands on its own GPU (CuPy's current device defaults to 0
in each new thread). Used for the worker processes of ``--spread workers`` (server/workers.py) and for each
device process of a Service on several devices (server/service.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from clefcore.device import Device

VISIBLE = "CUDA_VISIBLE_DEVICES"


@contextlib.contextmanager
def alone(device: str) -> Iterator[str]:
    """While open, a process spawned sees only ``device``'s GPU; yields the name it loads it as ("cuda:0", or
    ``device`` itself when it is not a GPU). The environment is restored on leaving."""
    inherited = os.environ.get(VISIBLE)
    try:
        yield _isolate(device, inherited)
    finally:
        if inherited is None:
            os.environ.pop(VISIBLE, None)
        else:
            os.environ[VISIBLE] = inherited


def _isolate(device: str, inherited: str | None) -> str:
    parsed = Device.parse(device)
    if parsed.kind != "cuda":
        return device
    index = parsed.index
    visible = inherited.split(",") if inherited else [str(i) for i in range(index + 1)]
    if index >= len(visible):
        raise ValueError(f"device {device}: {VISIBLE}={inherited} shows only {len(visible)} GPU(s)")
    os.environ[VISIBLE] = visible[index]
    return "cuda:0"
