"""Where the image fixtures live: the copy in tests/golden_images, or the full set in ../shared when present."""

from __future__ import annotations

import json
from pathlib import Path

LOCAL = Path(__file__).parent / "golden_images"
SHARED = Path(__file__).resolve().parents[2] / "shared" / "golden-images"
MODEL = LOCAL / "model"
REQUESTS = [json.loads(line) for line in (LOCAL / "requests.jsonl").read_text(encoding="utf-8").splitlines()]
REQUEST_BYTES = (LOCAL / "requests.jsonl").read_bytes().splitlines()
EXPECTED = [json.loads(line) for line in (LOCAL / "expected.jsonl").read_text(encoding="utf-8").splitlines()]


def fixture_file(relative: str) -> Path | None:
    """A fixture file (``images/...``, ``states/...``) from the local copy, else from ../shared, else None."""
    for root in (LOCAL, SHARED):
        if (root / relative).is_file():
            return root / relative
    return None


def image_file(name: str) -> Path | None:
    for root in (LOCAL, SHARED):
        hits = sorted((root / "images").glob(f"*_{name}.safetensors"))
        if hits:
            return hits[0]
    return None
