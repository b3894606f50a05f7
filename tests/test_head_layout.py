"""The joint head's layout and its graph routing without a GPU (clefcore/model/head.py, the head_graph switch):
the key tells apart every two layouts that differ in what fixes the head's launches and equals for equal layouts
whatever their tokens; equal keys mean equal index tables; the one routing decision (graphs_for) and heads()
through a graph cache; the readout's precomputed block indices; the bounded memory of a GraphCache's keys; the
switch off runs CuPy's own ops (checked on stand-ins); and a numpy model of the deterministic segment kernel
(clefcore/backends/cuda/elementwise.py::segment_softmax_sum_k) against its numpy twin, bit for bit."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest

from clefcore import switches
from clefcore.backends import cpu
from clefcore.backends.cpu import CpuOps
from clefcore.backends.cuda import graphs as graphs_module
from clefcore.backends.cuda.graphs import GraphCache
from clefcore.backends.cuda.head import HeadOps
from clefcore.checkpoint import Checkpoint
from clefcore.model import head as head_module
from clefcore.model.head import HeadLayout, graphs_for, head_rows, heads, readout
from clefcore.model.params import load_params
from clefcore.precision import Plan

GOLD = Path(__file__).parent / "golden" / "model"


def q(span, options, type_index=1):
    """A question as the head reads it (EncodedQuestion's fields the head uses)."""
    return types.SimpleNamespace(question_span=span, option_spans=tuple(options), type_index=type_index)


# two sequences (60 and 40 tokens): a noul question and a 3-option choice, then a score question
BASE = ([0, 60, 100], [[q((5, 9), [(10, 12), (12, 15)], 0), q((20, 24), [(25, 27), (27, 30), (30, 31)], 1)],
                       [q((3, 6), [(7, 9), (9, 12)], 2)]])


def _layout(cu=None, qs=None, block=4096):
    cu0, qs0 = BASE
    return HeadLayout(cu0 if cu is None else cu, qs0 if qs is None else qs, block)


def _with(seq, i, **changes):
    """BASE's questions with question i of sequence seq changed."""
    qs = [list(s) for s in BASE[1]]
    old = qs[seq][i]
    qs[seq][i] = q(changes.get("span", old.question_span), changes.get("options", old.option_spans),
                   changes.get("type_index", old.type_index))
    return qs


VARIANTS = {
    "token count": dict(cu=[0, 60, 101]),
    "sequence split": dict(cu=[0, 61, 100]),
    "question type": dict(qs=_with(0, 0, type_index=1)),
    "question span start": dict(qs=_with(0, 1, span=(19, 24))),
    "question span end": dict(qs=_with(0, 1, span=(20, 25))),
    "option span start": dict(qs=_with(0, 1, options=[(25, 27), (28, 30), (30, 31)])),
    "option span end": dict(qs=_with(1, 0, options=[(7, 9), (9, 13)])),
    "option count": dict(qs=_with(0, 1, options=[(25, 27), (27, 30)])),
    "question count": dict(qs=[BASE[1][0], BASE[1][1] + [q((14, 16), [(16, 18), (18, 20)], 0)]]),
    "questions moved between sequences": dict(qs=[BASE[1][0][:1], [BASE[1][0][1]] + BASE[1][1]]),
    "token block": dict(block=64),
}


@pytest.mark.parametrize("what", sorted(VARIANTS))
def test_every_launch_relevant_field_changes_the_key(what):
    assert _layout().key != _layout(**VARIANTS[what]).key


def test_equal_layouts_have_equal_keys_and_tables_whatever_their_tokens():
    from clefcore.encode import EncodedQuestion
    cu, qs = BASE
    encoded = [[EncodedQuestion(f"q{i}", "choice", x.type_index, x.question_span,
                                tuple(f"o{j}" for j in range(len(x.option_spans))), x.option_spans)
                for i, x in enumerate(seq)] for seq in qs]
    a, b = HeadLayout(cu, qs, 4096), HeadLayout(np.array(cu, dtype=np.int32), encoded, 4096)
    assert a.key == b.key and hash(a.key) == hash(b.key)
    assert np.array_equal(a.table, b.table) and a.table.dtype == np.int64
    assert "100 tokens, 2 sequences, 3 questions, 7 options" in repr(a.key)      # logged short, not whole
    # the token ids reach the head as data (the option tokens' LM-head rows), never through the key
    ids = np.arange(100) * 7
    assert np.array_equal(a.option_tokens(ids), ids[[10, 11, 12, 13, 14, 25, 26, 27, 28, 29, 30, 67, 68, 69, 70, 71]])


def test_views_give_back_every_index_table():
    lay = _layout()
    views = lay.views(lay.table)
    for name in lay.host.__dataclass_fields__:
        assert np.array_equal(getattr(views, name), getattr(lay.host, name)), name
    assert np.array_equal(lay.rows[views.last], [59, 59, 99])                  # each question's sequence's last row
    assert np.array_equal(views.owner, [0, 0, 1, 1, 1, 2, 2]) and np.array_equal(views.types, [0, 1, 2])
    assert np.array_equal(views.opt_seq, [0, 0, 0, 0, 0, 1, 1]) and len(views.mem_seq) == 100


class _Recording(GraphCache):
    """GraphCache's routing without a GPU: records each run and runs it eagerly."""

    def __init__(self, max_tokens):
        super().__init__(None, max_tokens=max_tokens, capacity=8)
        self.calls = []

    def run(self, key, fn, inputs, reads):
        self.calls.append((key, inputs, list(reads)))
        return fn(*inputs)


def test_the_routing_decision():
    lay = _layout()
    assert graphs_for(CpuOps(), lay) is None                          # no head graphs (the switch off, the CPU)
    ops = CpuOps()
    ops.head_graphs = GraphCache(None, max_tokens=100, capacity=8)
    assert graphs_for(ops, lay) is ops.head_graphs                    # within the graphs' token limit
    ops.head_graphs = GraphCache(None, max_tokens=99, capacity=8)
    assert graphs_for(ops, lay) is None                               # a layout too large: launched one by one
    ops.head_graphs = GraphCache(None, max_tokens=0, capacity=8)
    assert graphs_for(ops, lay) is None                               # --graph-tokens 0
    ops.head_graphs = GraphCache(None, max_tokens=100, capacity=0)
    assert graphs_for(ops, lay) is None


def test_the_switch_is_off_by_default_and_named_once():
    s = switches.BY_NAME["head_graph"]
    assert s.default is False and s.env == "CLEFCORE_HEAD_GRAPH" and "not yet run on a GPU" in s.help
    assert "head_graph" not in switches.resolve(None, environ={})
    assert "head_graph" in switches.resolve(None, environ={"CLEFCORE_HEAD_GRAPH": "1"})
    root = Path(head_module.__file__).resolve().parents[1]
    readers = [p.relative_to(root).as_posix() for p in root.rglob("*.py")
               if '"head_graph"' in p.read_text() and p.name != "switches.py"]
    assert readers == ["backends/cuda/ops.py"]                         # the one place that reads it


@pytest.fixture(scope="module")
def cpu_model():
    return load_params(Checkpoint(GOLD), CpuOps())


def _stream(p, rng, cu, qs):
    T = int(cu[-1])
    hs = rng.standard_normal((T, p.text.hidden_size)).astype(np.float32)
    return hs, rng.integers(0, p.text.vocab_size, T)


def test_heads_go_through_the_cache_with_the_layout_as_key(cpu_model):
    p, rng = cpu_model, np.random.default_rng(7)
    cu, qs = BASE
    hs, ids = _stream(p, rng, cu, qs)
    want = heads(CpuOps(), p, hs, ids, cu, qs)
    ops = CpuOps()
    ops.head_graphs = rec = _Recording(max_tokens=1024)
    got = heads(ops, p, hs, ids, cu, qs)
    (key, inputs, reads), = rec.calls
    assert key == (HeadLayout(cu, qs, ops.token_block).key, ops.plan)
    assert inputs[0] is hs and inputs[2].dtype == np.int64 and inputs[1].shape == (16, p.text.hidden_size)
    assert len(reads) == len(p.head) and all(any(r is w for w in p.head.values()) for r in reads)
    for a, b in zip(got, want):
        for x, y in zip(a, b):
            assert np.array_equal(x, y)
    ops.head_graphs = rec = _Recording(max_tokens=50)                  # too large for it: never offered
    heads(ops, p, hs, ids, cu, qs)
    assert rec.calls == []


def test_readout_with_the_layouts_block_indices_equals_its_own(cpu_model):
    """HeadIndex.local (each head row's index in its token block) reads the rows HeadReadout.add would pick."""
    p, rng = cpu_model, np.random.default_rng(3)
    cu, qs = BASE
    hs, _ = _stream(p, rng, cu, qs)
    for block in (0, 16, 17, 64):
        ops = CpuOps()
        ops.token_block = block
        lay = HeadLayout(cu, qs, block)
        got = readout(ops, p, hs, lay.rows, lay.views(lay.table).local)
        want = readout(ops, p, hs, head_rows(cu, qs))
        assert np.array_equal(got.picked, want.picked) and np.array_equal(got.mem, want.mem)


def test_a_cache_remembers_a_bounded_number_of_keys(monkeypatch):
    """The head's keys come with the traffic: a cache forgets the oldest keys it has seen, and a key it forgot is
    taken for a first sighting again (run eagerly, never captured on a stale memory)."""
    monkeypatch.setattr(graphs_module, "REMEMBERED", 3)
    cache = GraphCache(None, max_tokens=1024, capacity=2)            # no ops: a capture would fail loudly
    ran = []
    for k in ("a", "b", "c", "d"):
        cache.run(k, lambda k=k: ran.append(k), (), ())
    cache.run("a", lambda: ran.append("a again"), (), ())            # forgotten: a first sighting, eager
    assert ran == ["a", "b", "c", "d", "a again"]
    with pytest.raises(AttributeError):                               # "d" is remembered: its second sighting
        cache.run("d", lambda: None, (), ())                          # captures (on no GPU: fails at once)


def test_switch_off_runs_cupys_own_ops():
    """With no head graphs (the switch off) the head's batched product is CuPy's matmul and the segment softmax
    CuPy's scatter ops: checked on numpy stand-ins, which CudaOps' head ops run unchanged."""
    calls = []
    fake = types.SimpleNamespace(cp=types.SimpleNamespace(matmul=lambda a, b: calls.append("matmul") or a @ b),
                                 cublas_missing=None, head_graphs=None)
    a, b = np.ones((2, 3, 4), np.float32), np.ones((2, 4, 5), np.float32)
    assert np.array_equal(HeadOps._bmm(fake, a, b), a @ b) and calls == ["matmul"]
    rng = np.random.default_rng(1)
    sc, vals, own = rng.standard_normal(9).astype(np.float32), rng.standard_normal((9, 5)).astype(np.float32), \
        np.array([0, 0, 1, 1, 1, 2, 2, 2, 2])
    fake = types.SimpleNamespace(cp=np, head_graphs=None, _f32=lambda x: np.asarray(x, np.float32),
                                 asarray=np.asarray)
    got = HeadOps.segment_softmax_sum(fake, sc, vals, own, 3)
    assert np.array_equal(got, cpu.segment_softmax_sum(sc, vals, own, 3))


def test_switch_on_routes_the_segment_softmax_to_one_kernel(monkeypatch):
    launched = []

    class Kernel:
        def __call__(self, scores, values, owner, n, width, out):
            launched.append((scores.shape, values.shape, owner.dtype, int(n), int(width), out.shape))
            return out

    monkeypatch.setattr("clefcore.backends.cuda.head.segment_softmax_sum_k", Kernel)
    fake = types.SimpleNamespace(cp=np, head_graphs=object(), _f32=lambda x: np.asarray(x, np.float32),
                                 _c=np.ascontiguousarray, asarray=np.asarray)
    HeadOps.segment_softmax_sum(fake, np.zeros(5, np.float32), np.zeros((5, 3), np.float32),
                                np.array([0, 0, 1, 1, 1]), 2)
    assert launched == [((5,), (15,), np.int64, 5, 3, (2, 3))]


def segment_kernel_model(scores, values, owner, n_groups):
    """clef_segment_softmax_sum, thread by thread: (q, j) finds its group's rows [a, b) by binary search in the
    non-decreasing owner, then max, sum of exps and weighted sum in row order, each operation rounded to fp32."""
    n, width = values.shape
    f = np.float32
    out = np.empty((n_groups, width), np.float32)
    for i in range(n_groups * width):
        qi, j = divmod(i, width)
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi) >> 1
            lo, hi = (mid + 1, hi) if owner[mid] < qi else (lo, mid)
        a, hi = lo, n
        while lo < hi:
            mid = (lo + hi) >> 1
            lo, hi = (mid + 1, hi) if owner[mid] <= qi else (lo, mid)
        b = lo
        m = f(-np.inf)
        for r in range(a, b):
            m = max(m, scores[r])
        e = np.exp(scores[a:b] - m)            # expf of each row (numpy's fp32 exp, as the twin's)
        den = f(0)
        for r in range(b - a):
            den = f(den + e[r])
        acc = f(0)
        for r in range(b - a):
            acc = f(acc + f(f(e[r] / den) * values[a + r, j]))
        out[qi, j] = acc
    return out


@pytest.mark.parametrize("sizes", [[1], [2, 3], [255], [1, 0, 4, 0, 2], [0, 3], [3, 0]])
def test_segment_kernel_model_is_its_numpy_twin_bit_for_bit(sizes):
    """The kernel adds in row order, as np.add.at does: the model and the twin agree in every bit, empty groups
    (zero rows: an output of zeros) and groups at either end included."""
    rng = np.random.default_rng(len(sizes) * 100 + sum(sizes))
    owner = np.repeat(np.arange(len(sizes)), sizes)
    n = len(owner)
    for width in (1, 7, 33):
        sc = (rng.standard_normal(n) * 4).astype(np.float32)
        vals = rng.standard_normal((n, width)).astype(np.float32)
        got = segment_kernel_model(sc, vals, owner, len(sizes))
        want = cpu.segment_softmax_sum(sc, vals, owner, len(sizes))
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_plans_name_different_graphs():
    """A graph is kept per plan (the range-safe fallback runs other kernels): the key the head passes differs."""
    lay = _layout()
    assert (lay.key, Plan("fp16")) != (lay.key, Plan("split", range_safe=True))
