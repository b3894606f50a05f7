"""The golden request bodies (tests/golden/requests.jsonl) and, prepared by an engine, the ones it accepts (the
set also holds bodies every engine must refuse): real prompts of several lengths for the engine's tests. Tests
import it by name: conftest.py puts this folder on sys.path."""

from __future__ import annotations

import json
from pathlib import Path

import clefcore

GOLD = Path(__file__).parent / "golden"
BODIES = [json.loads(line) for line in (GOLD / "requests.jsonl").read_text().splitlines()]


def accepted(engine) -> list:
    """``engine.prepare`` of every golden body that it accepts, in the file's order."""
    prepared = []
    for body in BODIES:
        try:
            prepared.append(engine.prepare(body))
        except clefcore.ClefError:
            continue
    return prepared
