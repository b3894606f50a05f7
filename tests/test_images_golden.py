"""Requests with images end to end on the CPU (numpy) path against shared/golden-images: the CLI with --debug,
the engine's logits, responses and per-layer states, packing with text-only requests, chunked prefill, and the
GPU's refusal. Tolerances are the fixture README's (logits 2e-4 absolute, states 2e-4 relative, response numbers
1e-4)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import clefcore
from clefcore.errors import RequestError
from clefcore.jsonvalue import parse_body

sys.path.insert(0, str(Path(__file__).parent))
from golden_images_data import EXPECTED, MODEL, REQUEST_BYTES, fixture_file  # noqa: E402
from test_golden import check_cli_against_fixture  # noqa: E402

OK = [fx for fx in EXPECTED if "error" not in fx]


@pytest.fixture(scope="module")
def engine():
    return clefcore.load(MODEL, device="cpu", confidence="reference", validation="reference")


def prepared(engine, index):
    engine.max_length = EXPECTED[index]["max_length"]
    return engine.prepare(parse_body(REQUEST_BYTES[index]))


@pytest.mark.parametrize("fx", EXPECTED, ids=[fx["name"] for fx in EXPECTED])
def test_cli_reproduces_fixture(fx, tmp_path):
    out = check_cli_against_fixture(MODEL, REQUEST_BYTES[fx["index"]], fx, tmp_path, timeout=300)
    if "error" not in fx:
        assert out["usage"]["input_tokens"] == fx["num_tokens"]


@pytest.mark.parametrize("fx", OK, ids=[fx["name"] for fx in OK])
def test_states_and_logits(fx, engine):
    p = prepared(engine, fx["index"])
    logits, hs, layers = engine.forward([p.record], keep_layers=True)
    for got, want in zip(logits[0], fx["questions"], strict=True):
        np.testing.assert_allclose(got, want["logits"], rtol=0, atol=2e-4)
    states = fixture_file(fx["states_file"])
    if states is None:
        return
    st = load_file(str(states))
    rows, embeds = engine.image_inputs([p.record])
    x = clefcore.model.embed_with_images(engine.ops, engine.params, p.record.input_ids, rows, embeds)
    assert np.abs(x - st["inputs_embeds"]).max() / np.abs(st["inputs_embeds"]).max() < 2e-4
    for i, (got, want) in enumerate(zip(layers, st["layer_outputs"], strict=True)):
        rel = np.abs(got - want).max() / np.abs(want).max()
        assert rel < 2e-4, f"layer {i}: {rel:.2e}"
    assert np.abs(hs - st["last_hidden_state"]).max() / np.abs(st["last_hidden_state"]).max() < 2e-4


def test_packed_with_text_only_requests(engine):
    """Image and text-only requests in one forward: each answer equals its own forward's."""
    text = json.loads((Path(__file__).parent / "golden" / "requests.jsonl").read_text().splitlines()[0])
    records = [prepared(engine, 3).record, engine.prepare(text).record, prepared(engine, 0).record]
    packed, _, _ = engine.forward(records)
    for rec, z_packed in zip(records, packed):
        (z_single,), _, _ = engine.forward([rec])
        for a, b in zip(z_packed, z_single):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    for got, want in zip(packed[0], EXPECTED[3]["questions"]):
        np.testing.assert_allclose(got, want["logits"], rtol=0, atol=2e-4)


def test_chunked_equals_whole(engine):
    p = prepared(engine, 3)
    (whole,), _, _ = engine.forward([p.record])
    for chunk in (37, 100):        # chunk borders inside image pad runs; GEMMs over other row counts round apart
        run = engine.chunked(p, chunk)
        while not run.step():
            pass
        for a, b in zip(run.logits(), whole):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)


def test_gpu_engine_refuses_images_by_name(engine):
    """No GPU here: an engine whose device is not the CPU must get the refusal, never a text-only answer."""
    saved = (engine.device, engine.vision, engine.images_refused)
    try:
        engine.device = "cuda:0"
        engine.vision, engine.images_refused = engine._load_vision()
        assert engine.vision is None
        with pytest.raises(RequestError) as info:
            prepared(engine, 0)
        assert info.value.message == "images: not supported on the GPU yet" and info.value.field == "images"
        assert info.value.to_json()["error"]["type"] == "invalid_request_error"   # a 422 at the server
    finally:
        engine.device, engine.vision, engine.images_refused = saved


def test_model_without_a_vision_tower_refuses_images(tmp_path):
    """config.json without vision_config (a text-only checkpoint): image requests get a 422, text still answers."""
    import shutil
    shutil.copytree(MODEL, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    del config["vision_config"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    eng = clefcore.load(tmp_path / "m", device="cpu", validation="reference")
    body = json.loads(REQUEST_BYTES[0])
    with pytest.raises(RequestError) as info:
        eng.decide(body)
    assert info.value.message == "images: this model has no vision tower" and info.value.field == "images"
    del body["images"]
    assert eng.decide(body)["usage"]["input_tokens"] == EXPECTED[0]["num_tokens"] - EXPECTED[0]["image_tokens"] - 3
