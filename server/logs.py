"""Structured logs: one JSON object per line on stderr, so that `kubectl logs` output can be fed to any
log pipeline without a parser. Every HTTP request produces exactly one ``"event": "request"`` line."""

from __future__ import annotations

import json
import sys
import time


def log(event: str, level: str = "info", **fields) -> None:
    record = {"ts": round(time.time(), 3), "level": level, "event": event}
    record.update(fields)
    # default=str: a log line must never be the thing that fails a request.
    sys.stderr.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
    sys.stderr.flush()
