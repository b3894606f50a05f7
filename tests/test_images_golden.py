"""Requests with images end to end on the CPU path against shared/golden-images. Tolerances are the fixture
README's (logits 2e-4 absolute, states 2e-4 relative, response numbers 1e-4)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

import clefcore
from clefcore.errors import RequestError
from clefcore.example_request import support_ticket
from clefcore.jsonvalue import parse_body
from clefcore.model.backbone import embed_with_images
from clefcore.preparer import Preparer

from golden_images_data import EXPECTED, MODEL, REQUEST_BYTES, fixture_file
from golden_requests import BODIES
from test_golden import check_cli_against_fixture, rel

OK = [fx for fx in EXPECTED if "error" not in fx]


@pytest.fixture(scope="module")
def engine():
    return clefcore.load(MODEL, device="cpu", confidence="reference", validation="reference")


def prepared(engine, index):
    """The fixture's request prepared at the fixture's prompt limit."""
    host = Preparer(engine.checkpoint, EXPECTED[index]["max_length"], "reference", engine.images_refused)
    return host.prepare(parse_body(REQUEST_BYTES[index]))


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
    x = embed_with_images(engine.ops, engine.params, p.record.input_ids, rows, embeds)
    assert rel(x, st["inputs_embeds"]) < 2e-4
    for i, (got, want) in enumerate(zip(layers, st["layer_outputs"], strict=True)):
        assert (r := rel(got, want)) < 2e-4, f"layer {i}: {r:.2e}"
    assert rel(hs, st["last_hidden_state"]) < 2e-4


def test_packed_with_text_only_requests(engine):
    """Image and text-only requests in one forward: each answer equals its own forward's."""
    records = [prepared(engine, 3).record, engine.prepare(BODIES[0]).record, prepared(engine, 0).record]
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


def test_no_images_deployment_refuses_images_by_name():
    """images=False (--no-images): the tower is never loaded and image requests get a 422 naming the field;
    text-only requests answer as before."""
    eng = clefcore.load(MODEL, device="cpu", validation="reference", images=False)
    assert eng.vision is None and eng.params.mrope_section is None
    error = _refuses_images_answers_text(eng, clefcore.engine.NO_IMAGES)
    assert "--no-images" in error.message
    assert error.to_json()["error"]["type"] == "invalid_request_error"   # a 422 at the server


def _refuses_images_answers_text(eng, message):
    """The first fixture refused on field images with ``message``; without its images, answered."""
    body = json.loads(REQUEST_BYTES[0])
    with pytest.raises(RequestError) as info:
        eng.decide(body)
    assert info.value.message == message and info.value.field == "images"
    del body["images"]
    assert eng.decide(body)["usage"]["input_tokens"] == EXPECTED[0]["num_tokens"] - EXPECTED[0]["image_tokens"] - 3
    return info.value


def test_serve_no_images_answers_422_naming_images():
    """The server's --no-images: an image request gets a 422 on field images, its ready line says why; the same
    server answers text, and one started without the flag answers the image."""
    from clefcore.synth import data_url, picture_png
    from server_harness import SUPPORT_TICKET, Server
    body = dict(SUPPORT_TICKET, images=[data_url(picture_png(64, 48))])
    with Server("--no-images") as s:
        s.wait_ready()
        reply = s.decide(body)
        assert reply.status == 422, reply
        err = reply.json()["error"]
        assert err["field"] == "images" and err["message"] == clefcore.engine.NO_IMAGES
        assert s.events("ready")[0]["images"] == clefcore.engine.NO_IMAGES
        assert s.decide(SUPPORT_TICKET).status == 200
    with Server() as s:
        s.wait_ready()
        reply = s.decide(body)
        assert reply.status == 200, reply
        assert s.events("ready")[0]["images"] == "answered"


def test_tower_row_blocks_give_the_same_embeddings(engine):
    """On the GPU the tower's MLP runs over row blocks of token_block; on numpy the blocks change nothing (the
    four-image request: block borders inside images and between them)."""
    import types
    p = prepared(engine, 3)
    pixels = np.concatenate([px.values for px in p.record.images])
    grids = [px.grid_thw for px in p.record.images]
    whole = clefcore.model.vision.tower(engine.ops, engine.vision, pixels, grids)
    blocked = types.SimpleNamespace(**{k: getattr(engine.ops, k) for k in dir(engine.ops) if not k.startswith("__")})
    blocked.token_block = 37
    np.testing.assert_allclose(clefcore.model.vision.tower(blocked, engine.vision, pixels, grids), whole, rtol=0,
                               atol=1e-6 * np.abs(whole).max())


def test_model_without_a_vision_tower_refuses_images(tmp_path):
    """config.json without vision_config (a text-only checkpoint): image requests get a 422, text still answers."""
    import shutil
    shutil.copytree(MODEL, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    del config["vision_config"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    eng = clefcore.load(tmp_path / "m", device="cpu", validation="reference")
    _refuses_images_answers_text(eng, "images: this model has no vision tower")


def test_synth_vision_writes_a_complete_tower(tmp_path):
    """synth --vision: the tiny preset's tower answers an image request; clef-flash's plan holds the release's
    tower (333 tensors, 456,010,480 parameters, qwen35-backbone.md §2) and its vision_config."""
    from clefcore import synth
    from clefcore.model.vision import PREFIX
    out = synth.write("tiny", 0, tmp_path / "tiny", jobs=1, vision=True)
    eng = clefcore.load(out)
    assert eng.vision is not None and eng.vision.config.depth == 2
    body = dict(support_ticket(), images=[synth.data_url(synth.picture_png(64, 48))])
    assert eng.decide(body)["usage"]["input_tokens"] == eng.decide(support_ticket())[
        "usage"]["input_tokens"] + 70 + 3
    plan = {n: spec for _, shard in synth._text_shards("clef-flash", 0, vision=True) for n, spec in shard.items()}
    tower = {n: spec[1] for n, spec in plan.items() if n.startswith(PREFIX)}
    assert len(tower) == 333 and sum(int(np.prod(s)) for s in tower.values()) == 456_010_480
    assert tower[PREFIX + "patch_embed.proj.weight"] == (1152, 3, 2, 16, 16)
    vc = synth.config_json("clef-flash", vision=True)["vision_config"]
    assert (vc["depth"], vc["hidden_size"], vc["num_heads"], vc["out_hidden_size"]) == (27, 1152, 16, 4096)
    assert "vision_config" not in synth.config_json("clef-flash", vision=False)


def test_tower_load_reports_progress():
    """The tower's tensors tick the same progress callback as the backbone's (clefcore/progress.py's bar)."""
    calls = []
    clefcore.load(MODEL, device="cpu", progress=lambda done, total, what: calls.append((done, total, what)))
    tower = [c for c in calls if c[2].startswith("model.visual.")]
    assert tower and tower[-1][0] == tower[-1][1] == len(tower) and calls.index(tower[0]) > 0


def test_chunked_with_the_tower_split_equals_golden(engine):
    """The vision tower run image by image, a step each, before the text chunks: the answers stay within the
    fixtures' tolerance and equal the run whose first chunk carries the whole tower."""
    for fx in OK:
        index = fx["index"]
        p = prepared(engine, index)
        whole = engine.chunked(p, 100)
        while not whole.step():
            pass
        split = engine.chunked(p, 100)
        steps = 0
        while split.images_left:
            left = split.images_left
            assert not split.step(images=1) and split.images_left == left - 1
            assert split.tokens_left == len(p.record.input_ids)     # no text ran in a tower step
            steps += 1
        assert steps == len(p.record.images)
        while not split.step():
            pass
        for got, same, want in zip(split.logits(), whole.logits(), fx["questions"], strict=True):
            np.testing.assert_allclose(got, same, rtol=0, atol=1e-5)
            np.testing.assert_allclose(got, want["logits"], rtol=0, atol=2e-4)
