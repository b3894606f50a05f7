"""Server phases and the ordered start and stop.

loading ─► ready ─► draining ─► (exit)
   └──► failed (load or self-check failed: the process exits non-zero so Kubernetes restarts it)

``/health`` is 200 only in ``ready``. SIGTERM (and SIGINT) moves to ``draining``: new decision requests get
503, requests already accepted (queued or on the device) are answered, and the process exits once they
are done or ``--shutdown-timeout`` has passed, whichever comes first.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Callable

LOADING, READY, DRAINING, FAILED = "loading", "ready", "draining", "failed"


class Lifecycle:
    def __init__(self) -> None:
        self.phase = LOADING
        self.reason = "loading the model"
        self.stop_requested = asyncio.Event()
        self.in_flight = 0  # decision requests past the phase check and not yet answered
        self.started_at = time.time()

    def set(self, phase: str, reason: str) -> None:
        self.phase = phase
        self.reason = reason

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_requested.set)

    async def wait_drained(self, is_idle: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until every accepted request is answered; False if the timeout came first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.in_flight == 0 and is_idle():
                return True
            await asyncio.sleep(0.02)
        return self.in_flight == 0 and is_idle()
