"""The golden sets through a numpy emulation, for the studies beside this file: a set's model loaded through the
emulation's ops (its ``weight`` at load, as an engine loads), every request the fixtures answer prepared as the
engine prepares it (images decoded, the tower run), and each question's option probabilities beside the fixture's.

tests/golden (text) and tests/golden_images (requests with images) are the two sets; ../shared/golden and
../shared/golden-images hold byte-identical copies of their requests, answers and weights (``same_as_local``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from clefcore.checkpoint import Checkpoint
from clefcore.engine import image_inputs, packed_positions
from clefcore.jsonvalue import parse_body
from clefcore.model import vision
from clefcore.model.backbone import backbone
from clefcore.model.head import heads
from clefcore.model.params import load_params
from clefcore.preparer import Preparer

ROOT = Path(__file__).resolve().parents[2]
SETS = {"text": ROOT / "tests" / "golden", "images": ROOT / "tests" / "golden_images"}
SHARED = {"text": ROOT.parent / "shared" / "golden", "images": ROOT.parent / "shared" / "golden-images"}


@dataclass
class Loaded:
    """One golden set's model in an emulation's ops, and its answered requests."""
    ops: object
    checkpoint: Checkpoint
    params: object
    vision: object
    records: list        # EncodedRecord per answered fixture, in the file's order
    reference: list      # the fixture's probabilities, one float64 array per question, in the same order


def load(gold: Path, ops) -> Loaded:
    ck = Checkpoint(gold / "model")
    params = load_params(ck, ops)
    vp, refused = vision.attach(ck, ops, params)
    bodies = (gold / "requests.jsonl").read_bytes().splitlines()
    records, reference = [], []
    for line in (gold / "expected.jsonl").read_text().splitlines():
        fx = json.loads(line) if line.strip() else {}
        if "input_ids" not in fx:
            continue                          # a request the reference refuses
        rec = Preparer(ck, fx["max_length"], "reference", refused).prepare(parse_body(bodies[fx["index"]])).record
        if list(rec.input_ids) != fx["input_ids"]:
            raise AssertionError(f"{gold.name} {fx['name']}: the engine's ids differ from the fixture's")
        records.append(rec)
        reference.extend(np.array(q["probabilities"]) for q in fx["questions"])
    return Loaded(ops, ck, params, vp, records, reference)


def probabilities(m: Loaded) -> list[np.ndarray]:
    """Each question's option probabilities (float64 softmax of the logits), one request at a time."""
    out = []
    for rec in m.records:
        ids = np.asarray(rec.input_ids, np.int64)
        cu = np.array([0, len(ids)])
        rows, embeds = image_inputs(m.ops, m.vision, [rec])
        hs, _ = backbone(m.ops, m.params, ids, cu, packed_positions([rec]), image_rows=rows, image_embeds=embeds)
        for z in heads(m.ops, m.params, hs, ids, cu, [rec.questions])[0]:
            z = np.asarray(z, np.float64)
            p = np.exp(z - z.max())
            out.append(p / p.sum())
    return out


def abs_dp(m: Loaded) -> list[np.ndarray]:
    """|p - p_fixture| per option, one array per question."""
    return [np.abs(p - ref) for p, ref in zip(probabilities(m), m.reference, strict=True)]


def weight_names(params) -> dict[int, str]:
    """id(array) -> "layers.{i}.{name}" for the backbone's per-layer weights (the emulations file GEMMs by it)."""
    return {id(w): f"layers.{i}.{k}" for i, layer in enumerate(params.layers) for k, w in layer.items()}


def same_as_local(name: str) -> bool | None:
    """Whether ../shared's copy of a set has the same requests, answers and model files (None: no copy there)."""
    local, shared = SETS[name], SHARED[name]
    if not shared.is_dir():
        return None
    files = ["requests.jsonl", "expected.jsonl"] + sorted(f"model/{p.name}" for p in (local / "model").iterdir())
    return all((shared / f).is_file() and (shared / f).read_bytes() == (local / f).read_bytes() for f in files)
