"""The vision tower on the numpy backend (clefcore/model/vision.py) against the reference's per-stage tensors."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file

from clefcore.backends import cpu
from clefcore.backends.cpu import CpuOps
from clefcore.checkpoint import Checkpoint
from clefcore.model import vision
from clefcore.precision import Plan

from golden_images_data import EXPECTED, MODEL, fixture_file, image_file
from test_golden import rel

NUMPY = CpuOps()
PARAMS = vision.load_vision(Checkpoint(MODEL), NUMPY)
TOL = 1e-5   # relative to the tensor's largest value: the fixture README's suggestion for the vision tensors


def pixels_of(fx):
    files = [image_file(img["image"]) for img in fx["images"]]
    if None in files:
        return None
    return np.concatenate([load_file(str(f))["pixel_values"] for f in files])


WITH_STATES = [fx for fx in EXPECTED if "error" not in fx]


@pytest.mark.parametrize("fx", WITH_STATES, ids=[fx["name"] for fx in WITH_STATES])
def test_stages_match_the_reference(fx):
    states, pixels = fixture_file(fx["states_file"]), pixels_of(fx)
    if states is None or pixels is None:
        pytest.skip("states or images only in ../shared/golden-images (or not kept there)")
    st = load_file(str(states))
    keep = {}
    out = vision.tower(NUMPY, PARAMS, pixels, [tuple(img["grid_thw"]) for img in fx["images"]], keep)
    assert rel(keep["patch_embeds"], st["vision_patch_embeds"]) < TOL
    assert rel(keep["pos_embeds"], st["vision_pos_embeds"]) < TOL
    assert len(keep["blocks"]) == len(st["vision_block_outputs"])
    for got, want in zip(keep["blocks"], st["vision_block_outputs"]):
        assert rel(got, want) < TOL
    assert out.shape == st["image_embeds"].shape and rel(out, st["image_embeds"]) < TOL


def test_each_image_attends_only_to_itself():
    a = load_file(str(image_file("shapes_64x48")))
    b = load_file(str(image_file("banner_300x40_palette")))
    grids = [tuple(a["image_grid_thw"][0]), tuple(b["image_grid_thw"][0])]
    both = vision.tower(NUMPY, PARAMS, np.concatenate([a["pixel_values"], b["pixel_values"]]), grids)
    alone = vision.tower(NUMPY, PARAMS, a["pixel_values"], grids[:1])
    n = len(alone)
    np.testing.assert_allclose(both[:n], alone, rtol=0, atol=1e-6 * np.abs(alone).max())
    other = vision.tower(NUMPY, PARAMS, b["pixel_values"], grids[1:])
    np.testing.assert_allclose(both[n:], other, rtol=0, atol=1e-6 * np.abs(other).max())


def test_position_resampling_corners_hit_the_table():
    # align_corners=True: the four corner patches read the four corner entries of the table exactly
    c = PARAMS.config
    rows, weights = vision.position_weights(c, 4, 6)
    raster = np.arange(24).reshape(4, 6)
    order = vision._block_order(raster, 2)
    for r, col, entry in ((0, 0, 0), (0, 5, c.side - 1), (3, 0, c.side * (c.side - 1)), (3, 5, c.side ** 2 - 1)):
        i = int(np.nonzero(order == raster[r, col])[0][0])
        assert rows[i][np.argmax(weights[i])] == entry and weights[i].max() == 1.0


def test_gelu_tanh_and_bidirectional_attention_ops():
    x = np.linspace(-6, 6, 101, dtype=np.float32)
    want = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x.astype(np.float64) ** 3)))
    np.testing.assert_allclose(cpu.gelu_tanh(x), want, atol=1e-6)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((7, 2, 4)).astype(np.float32) for _ in range(3))
    out = cpu.bidirectional_attention(q, k, v, np.array([0, 3, 7]), 0.5)
    for s0, s1 in ((0, 3), (3, 7)):
        sc = np.einsum("qhd,khd->hqk", q[s0:s1], k[s0:s1]) * 0.5
        p = np.exp(sc - sc.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        np.testing.assert_allclose(out[s0:s1], np.einsum("hqk,khd->qhd", p, v[s0:s1]), atol=1e-6)


def test_bidirectional_attention_blocks_give_the_same_rows(monkeypatch):
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((300, 3, 16)).astype(np.float32) for _ in range(3))
    cu = np.array([0, 280, 300])
    whole = cpu.bidirectional_attention(q, k, v, cu, 0.25)
    monkeypatch.setattr(cpu, "VISION_SCORES", 3 * 280 * 7)         # 7 query rows per block
    np.testing.assert_allclose(cpu.bidirectional_attention(q, k, v, cu, 0.25), whole, rtol=0, atol=1e-6)


class _GraphStandIn:
    """Stands in for CudaOps.tower_graphs on the host: records each run and answers as a graph does, into the one
    output buffer that every replay of its key rewrites."""

    def __init__(self, limit):
        self.limit, self.keys, self.buffers = limit, [], {}

    def fits(self, tokens):
        return 0 < tokens <= self.limit

    def run(self, key, fn, inputs, reads):
        self.keys.append(key)
        got = fn(*inputs)
        buf = self.buffers.setdefault(key, got)
        buf[...] = got
        return buf


def _graph_ops(path, limit):
    """The numpy backend on the plan ``path``, with graphs for the tower."""
    ops = CpuOps()
    ops.plan, ops.tower_graphs = Plan(path), _GraphStandIn(limit)
    return ops


def test_tower_graph_path_answers_as_eager_and_hands_out_its_own_copy():
    """The fast mode's tower goes through tower_graphs (one key per set of image sizes) and returns a copy: a second
    image of the same size, replayed into the same buffer, leaves the first answer as it was."""
    a = load_file(str(image_file("shapes_64x48")))
    grids = [tuple(a["image_grid_thw"][0])]
    px = [a["pixel_values"], -a["pixel_values"]]
    eager = [vision.tower(NUMPY, PARAMS, x, grids) for x in px]
    ops = _graph_ops("fp16", limit=1024)
    got = [vision.tower(ops, PARAMS, x, grids) for x in px]
    assert ops.tower_graphs.keys == [("vision tower", tuple(grids), Plan("fp16"))] * 2
    for g, e in zip(got, eager):
        np.testing.assert_array_equal(g, e)
    assert not np.allclose(got[0], got[1])


@pytest.mark.parametrize("path,limit", [("split", 1024), ("fp16", 10)])
def test_tower_stays_eager_in_exact_modes_and_past_the_limit(path, limit):
    a = load_file(str(image_file("shapes_64x48")))
    ops = _graph_ops(path, limit)
    out = vision.tower(ops, PARAMS, a["pixel_values"], [tuple(a["image_grid_thw"][0])])
    assert ops.tower_graphs.keys == [] and out.shape[0] == len(a["pixel_values"]) // 4
