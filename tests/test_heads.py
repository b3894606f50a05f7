"""The joint head over a packed batch (clefcore/model/head.py: heads) equals the head of each sequence alone, and masked
attention groups equal separate calls: CPU always, the GPU backend when CuPy sees one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gpu_only import HAVE_GPU

import clefcore
from clefcore.backends import cpu
from clefcore.jsonvalue import parse_body
from clefcore.model.backbone import backbone
from clefcore.model.head import heads

GOLD = Path(__file__).parent / "golden"
REQUESTS = (GOLD / "requests.jsonl").read_bytes().splitlines()
RNG = np.random.default_rng(3)


def test_mha_groups_equal_separate_calls():
    W, heads = 16, 2
    in_w, in_b = RNG.standard_normal((3 * W, W)).astype(np.float32) * 0.3, RNG.standard_normal(3 * W).astype(np.float32)
    out_w, out_b = RNG.standard_normal((W, W)).astype(np.float32) * 0.3, RNG.standard_normal(W).astype(np.float32)
    nq, nk = [3, 1, 300, 2], [10, 1, 7, 257]
    xq = RNG.standard_normal((sum(nq), W)).astype(np.float32)
    xkv = RNG.standard_normal((sum(nk), W)).astype(np.float32)
    gq, gk = np.repeat(np.arange(4), nq), np.repeat(np.arange(4), nk)
    got = cpu.mha(xq, xkv, in_w, in_b, out_w, out_b, heads, (gq, gk))
    cq, ck = np.cumsum([0] + nq), np.cumsum([0] + nk)
    for i in range(4):
        want = cpu.mha(xq[cq[i]:cq[i + 1]], xkv[ck[i]:ck[i + 1]], in_w, in_b, out_w, out_b, heads)
        np.testing.assert_allclose(got[cq[i]:cq[i + 1]], want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="no keys"):
        cpu.mha(xq[:3], xkv[:10], in_w, in_b, out_w, out_b, heads, (np.array([0, 0, 1]), np.zeros(10, int)))


def devices():
    """The CPU, and the first GPU (marked gpu) when CuPy sees one."""
    return ["cpu"] + ([pytest.param("cuda:0", marks=pytest.mark.gpu)] if HAVE_GPU else [])


@pytest.mark.parametrize("device", devices())
def test_packed_head_equals_one_by_one(device):
    # on the GPU the exact path: packed and alone run GEMMs of other row counts, which the autotune may give other
    # paths; in fast mode those differ at fp16's rounding, which would hide the packing's own errors
    eng = clefcore.load(GOLD / "model", device=device, **({} if device == "cpu" else {"precision": "exact"}))
    recs = []
    for line in REQUESTS[:8]:
        try:
            recs.append(eng.prepare(parse_body(line)).record)
        except clefcore.ClefError:
            continue
    assert len(recs) >= 4
    ops, p = eng.ops, eng.params
    lens = [len(r.input_ids) for r in recs]
    cu = np.concatenate([[0], np.cumsum(lens)])
    ids = np.concatenate([r.input_ids for r in recs]).astype(np.int64)
    pos = np.concatenate([np.arange(n) for n in lens])
    hs, _ = backbone(ops, p, ids, cu, pos)
    packed = heads(ops, p, hs, ids, cu, [r.questions for r in recs])
    assert len(packed) == len(recs)
    for i, r in enumerate(recs):
        alone = heads(ops, p, hs[cu[i]:cu[i + 1]], r.input_ids, np.array([0, lens[i]]), [r.questions])[0]
        assert [len(z) for z in packed[i]] == [len(q.option_spans) for q in r.questions]
        for zp, za in zip(packed[i], alone):
            np.testing.assert_allclose(zp, za, rtol=0, atol=2e-5 * max(1.0, float(np.abs(za).max())))
    print(f"HEADS {device}: {len(recs)} sequences packed == alone")
