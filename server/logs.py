"""Structured logs: one JSON object per line on stderr, so that `kubectl logs` output can be fed to any
log pipeline without a parser. Every HTTP request produces exactly one ``"event": "request"`` line, except
429s, which are counted in one ``"event": "refused"`` line a second."""

from __future__ import annotations

import asyncio
import json
import sys
import time


def log(event: str, level: str = "info", **fields) -> None:
    record = {"ts": round(time.time(), 3), "level": level, "event": event}
    record.update(fields)
    # default=str: a log line must never be the thing that fails a request.
    sys.stderr.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
    sys.stderr.flush()


class RefusalLog:
    """429s as one ``"event": "refused"`` line a second, with their count by reason, instead of one request
    line each: under a retry storm a line per refusal is event-loop time (and GIL) taken from the device
    thread. The line also says how many were refused only after their body was read (and tokenized), and the
    slowest refusal's time from arrival, so that a slow 429 can be told from a cheap one."""

    def __init__(self, interval_s: float = 1.0):
        self._interval = interval_s
        self._counts: dict[str, int] = {}
        self._read = 0
        self._slowest_s = 0.0
        self._since = 0.0
        self._timer = None

    def note(self, reason: str, seconds: float, read: bool) -> None:
        """Count one refusal that took ``seconds`` from arrival (``read``: after its body was read); the line
        is written ``interval_s`` after the first one it counts."""
        if not self._counts:
            self._since = time.time()
            self._timer = asyncio.get_running_loop().call_later(self._interval, self.flush)
        self._counts[reason] = self._counts.get(reason, 0) + 1
        self._read += read
        self._slowest_s = max(self._slowest_s, seconds)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._counts:
            log("refused", status=429, count=sum(self._counts.values()), reasons=self._counts,
                after_reading=self._read, slowest_ms=round(self._slowest_s * 1000, 1),
                window_s=round(time.time() - self._since, 3))
            self._counts, self._read, self._slowest_s = {}, 0, 0.0
