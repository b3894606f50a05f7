"""Requests with images encoded as the reference (clef-images.md §7, §9): placeholder ids, spans, truncation,
M-RoPE positions and the two error rows of the golden-images fixtures."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file

from clefcore.encode import Encoder, mrope_positions
from clefcore.errors import ContextLengthError, RequestError
from clefcore.images import load_images
from clefcore.preprocess import preprocess
from clefcore.tokenize import Tokenizer
from clefcore.validate import validate_request

from golden_images_data import EXPECTED, MODEL, REQUESTS, fixture_file

ENCODER = Encoder(Tokenizer(MODEL / "tokenizer.json"))


def encode(index: int):
    body = REQUESTS[index]
    pixels = tuple(preprocess(rgb) for rgb in load_images(body["images"]))
    request = validate_request({k: v for k, v in body.items() if k != "images"}, "reference")
    return ENCODER.encode(request, EXPECTED[index]["max_length"], pixels)


OK = [fx for fx in EXPECTED if "error" not in fx]


@pytest.mark.parametrize("fx", OK, ids=[fx["name"] for fx in OK])
def test_ids_spans_and_positions(fx):
    """State, image spans, M-RoPE positions (ids and question spans: test_images_golden's CLI test)."""
    rec = encode(fx["index"])
    assert list(rec.state_span) == fx["state_span"]
    assert rec.state_tokens_before_truncation == fx["state_tokens_before_truncation"]
    assert rec.state_truncated == fx["state_truncated"]
    assert len(rec.image_spans) == len(fx["images"])
    for (start, end, rows, cols), img in zip(rec.image_spans, fx["images"]):
        assert [start, end] == img["pad_span"] and [rows, cols] == img["llm_grid_hw"]
        assert rec.positions[0, start] == img["mrope_start"]
        assert (rec.positions[:, end] == img["mrope_start"] + img["mrope_advance"]).all()   # vision_end
    assert sum(end - start for start, end, _, _ in rec.image_spans) == fx["image_tokens"]
    assert int(rec.positions.max()) + 1 - len(rec.input_ids) == fx["rope_delta"]
    states = fixture_file(fx["states_file"])
    if states is not None:
        st = load_file(str(states))
        assert np.array_equal(rec.positions, st["position_ids"])
        pads = np.zeros(len(rec.input_ids), np.int64)
        for start, end, _, _ in rec.image_spans:
            pads[start:end] = 1
        assert np.array_equal(pads, st["mm_token_type_ids"])


@pytest.mark.parametrize("index,error,field", [(7, RequestError, "state"),           # a literal image pad
                                               (8, ContextLengthError, None)])       # schema + image tokens
def test_the_error_rows(index, error, field):
    with pytest.raises(error) as info:
        encode(index)
    assert info.value.message == EXPECTED[index]["error"] and field in (None, info.value.field)


def test_text_only_requests_accept_a_literal_pad_and_keep_plain_positions():
    body = REQUESTS[7]
    request = validate_request({k: v for k, v in body.items() if k != "images"}, "reference")
    rec = ENCODER.encode(request, 16384)
    assert rec.positions is None and rec.image_spans == () and rec.images == ()


def test_mrope_positions_by_hand():
    # 2 text tokens, a 2x3 merged grid (6 pads), 2 text tokens
    pos = mrope_positions(10, [(2, 8, 2, 3)])
    assert pos[:, :2].tolist() == [[0, 1]] * 3
    assert pos[0, 2:8].tolist() == [2] * 6
    assert pos[1, 2:8].tolist() == [2, 2, 2, 3, 3, 3]
    assert pos[2, 2:8].tolist() == [2, 3, 4, 2, 3, 4]
    assert pos[:, 8:].tolist() == [[5, 6]] * 3
