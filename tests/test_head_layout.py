"""The joint head's layouts and graph routing without a GPU (clefcore/model/head.py): one graph key per schema
and bucket, a numpy model of a replay (bit for bit, pad rows never reach a value), the exact layout within
fp32 reordering, and a numpy model of the deterministic segment kernel against its numpy twin."""

from __future__ import annotations

import types

import numpy as np
import pytest

from clefcore.backends import cpu
from clefcore.backends.cpu import CpuOps
from clefcore.backends.cuda import graphs as graphs_module
from clefcore.backends.cuda.graphs import GraphCache
from clefcore.backends.cuda.head import Head
from clefcore.model import head as head_module
from clefcore.model.head import HeadLayout, graph_tokens, head_rows, heads, padded_readout, readout
from clefcore.precision import Plan

BUCKET = GraphCache(None).bucket                     # the head pads as the backbone's graphs do: 128 tokens


def q(span, options, type_index=1):
    """A question as the head reads it (EncodedQuestion's fields the head uses)."""
    return types.SimpleNamespace(question_span=span, option_spans=tuple(options), type_index=type_index)


def _shifted(questions, by):
    """The same questions ``by`` tokens later in their sequence (a longer state before them)."""
    return [q((x.question_span[0] + by, x.question_span[1] + by),
              [(s + by, e + by) for s, e in x.option_spans], x.type_index) for x in questions]


# two sequences (60 and 40 tokens): a noul question and a 3-option choice, then a score question
BASE = ([0, 60, 100], [[q((5, 9), [(10, 12), (12, 15)], 0), q((20, 24), [(25, 27), (27, 30), (30, 31)], 1)],
                       [q((3, 6), [(7, 9), (9, 12)], 2)]])
# the same schema, other states: 15 more tokens before the first sequence's questions and 6 before the second's,
# 121 tokens in all (the same bucket), every position moved
SHIFTED = ([0, 75, 121], [_shifted(BASE[1][0], 15), _shifted(BASE[1][1], 6)])


def _padded(cu=None, qs=None, block=4096):
    cu = BASE[0] if cu is None else cu
    return HeadLayout(cu, BASE[1] if qs is None else qs, block, -(-int(cu[-1]) // BUCKET) * BUCKET)


def _with(seq, i, **changes):
    """BASE's questions with question i of sequence seq changed."""
    qs = [list(s) for s in BASE[1]]
    old = qs[seq][i]
    qs[seq][i] = q(changes.get("span", old.question_span), changes.get("options", old.option_spans),
                   changes.get("type_index", old.type_index))
    return qs


SCHEMA_CHANGES = {
    "question type": dict(qs=_with(0, 0, type_index=1)),
    "question span rows": dict(qs=_with(0, 1, span=(20, 25))),
    "option span rows": dict(qs=_with(1, 0, options=[(7, 9), (9, 13)])),
    "option count": dict(qs=_with(0, 1, options=[(25, 27), (27, 30)])),
    "question count": dict(qs=[BASE[1][0], BASE[1][1] + [q((14, 16), [(16, 18), (18, 20)], 0)]]),
    "questions moved between sequences": dict(qs=[BASE[1][0][:1], [BASE[1][0][1]] + BASE[1][1]]),
    "sequence count": dict(cu=[0, 60, 100, 110], qs=BASE[1] + [[]]),
    "bucket crossed": dict(cu=[0, 60, 129]),
    "token block": dict(block=64),
}
SAME_SCHEMA = {
    "state lengths": dict(cu=SHIFTED[0], qs=SHIFTED[1]),
    "token count within the bucket": dict(cu=[0, 60, 128]),
    "sequence split": dict(cu=[0, 61, 100]),
    "no padding at all": dict(cu=[0, 60, 128], qs=[BASE[1][0], _shifted(BASE[1][1], 27)]),
}


@pytest.mark.parametrize("what", sorted(SCHEMA_CHANGES))
def test_every_schema_change_and_a_bucket_crossing_change_the_key(what):
    assert _padded().key != _padded(**SCHEMA_CHANGES[what]).key


@pytest.mark.parametrize("what", sorted(SAME_SCHEMA))
def test_the_same_schema_with_other_positions_has_one_key(what):
    a, b = _padded(), _padded(**SAME_SCHEMA[what])
    assert a.key == b.key and hash(a.key) == hash(b.key)
    assert len(a.table) == len(b.table) and a.table.dtype == b.table.dtype == np.int64
    assert not np.array_equal(a.table, b.table)                       # the positions are data


def test_the_key_whatever_the_questions_objects_and_tokens():
    from clefcore.encode import EncodedQuestion
    cu, qs = BASE
    encoded = [[EncodedQuestion(f"q{i}", "choice", x.type_index, x.question_span,
                                tuple(f"o{j}" for j in range(len(x.option_spans))), x.option_spans)
                for i, x in enumerate(seq)] for seq in qs]
    a, b = HeadLayout(cu, qs, 4096, 128), HeadLayout(np.array(cu, dtype=np.int32), encoded, 4096, 128)
    assert a.key == b.key and np.array_equal(a.table, b.table)
    assert a.key.schema == (((0, 4, (2, 3)), (1, 4, (2, 3, 1))), ((2, 3, (2, 3)),))
    assert "128 padded tokens, 2 sequences, 3 questions, 7 options" in repr(a.key)   # logged short, not whole
    # the token ids reach the head as data (the option tokens' LM-head rows), never through the key
    ids = np.arange(100) * 7
    assert np.array_equal(a.option_tokens(ids), ids[[10, 11, 12, 13, 14, 25, 26, 27, 28, 29, 30, 67, 68, 69, 70, 71]])


def _spans_rows(cu, qs):
    """Every question span's rows, then every option span's, in the stream: as the head reads them."""
    seqs = [(b, x) for b in range(len(qs)) for x in qs[b]]
    spans = [(cu[b] + s, cu[b] + e) for b, x in seqs for s, e in [x.question_span]]
    spans += [(cu[b] + s, cu[b] + e) for b, x in seqs for s, e in x.option_spans]
    return np.concatenate([np.arange(s, e) for s, e in spans])


@pytest.mark.parametrize("stream, tokens", [(BASE, 128), (SHIFTED, 128), (BASE, None)],
                         ids=["base", "shifted", "exact"])
def test_a_layouts_table_holds_its_own_positions(stream, tokens):
    cu, qs = stream
    lay = HeadLayout(cu, qs, 4096, tokens)
    ix = lay.views(lay.table)
    T = cu[-1]
    if tokens is None:   # the exact layout is today's: head rows sorted and unique, the host's views, no key (no graph)
        assert lay.key is None and lay.tokens == T and np.array_equal(lay.rows, head_rows(cu, qs))
        for name in lay.host.__dataclass_fields__:
            assert np.array_equal(getattr(ix, name), getattr(lay.host, name)), name
    assert np.array_equal(ix.local, lay.rows)                         # one 4096-token block: the whole stream
    assert np.array_equal(lay.rows[ix.span_rows], _spans_rows(cu, qs))
    assert np.array_equal(lay.rows[ix.last], [cu[1] - 1, cu[1] - 1, T - 1])
    assert np.array_equal(ix.mem_seq, np.repeat([0, 1, 2], [cu[1], T - cu[1], lay.tokens - T]))   # pad rows: group B
    # what the schema fixes: the same in all
    assert np.array_equal(ix.owner, [0, 0, 1, 1, 1, 2, 2]) and np.array_equal(ix.types, [0, 1, 2])
    assert np.array_equal(ix.q_seq, [0, 0, 1]) and np.array_equal(ix.opt_seq, [0, 0, 0, 0, 0, 1, 1])
    assert np.array_equal(ix.span_starts, [0, 4, 8, 11, 13, 16, 18, 21, 22, 24]) and ix.span_ends[-1] == 27
    assert np.array_equal(ix.lex_starts, [0, 2, 5, 7, 10, 11, 13]) and ix.lex_ends[-1] == 16
    assert len(lay.rows) == 27 + 2 and np.all(lay.rows < T)            # never a pad row


def test_a_padded_layout_keeps_coinciding_rows_apart():
    """Where a sequence's last row is also an option's, the exact layout reads it once and the padded one twice:
    its number of head rows is the schema's, whatever the positions."""
    cu, qs = [0, 31], [[q((20, 24), [(25, 27), (27, 31)], 1)]]
    assert len(HeadLayout(cu, qs, 0).rows) == 10 and len(HeadLayout(cu, qs, 0, 128).rows) == 11
    assert HeadLayout(cu, qs, 0, 128).key == HeadLayout([0, 40], qs, 0, 128).key


@pytest.mark.parametrize("cu,tokens,match", [(BASE[0], 99, "99 padded tokens for a stream of 100"),
                                             ([0, 100, 100], 128, "a sequence with questions has no tokens")])
def test_bad_padding_is_refused(cu, tokens, match):
    with pytest.raises(ValueError, match=match):
        HeadLayout(cu, BASE[1], 4096, tokens)


def test_graph_cache_padding():
    g = GraphCache(None, max_tokens=1024, capacity=8)
    assert [g.padded_tokens(T) for T in (1, 127, 128, 129, 1000, 1024, 1025, 0)] == \
        [128, 128, 128, 256, 1024, 1024, None, None]
    assert g.padded_length(129, 1) == 256 and g.padded_length(129, 2) is None   # the backbone's: one sequence


class _Recording(GraphCache):
    """GraphCache's routing without a GPU: records each run and runs it eagerly."""

    def __init__(self, max_tokens):
        super().__init__(None, max_tokens=max_tokens, capacity=8)
        self.calls = []

    def run(self, key, fn, inputs, reads):
        self.calls.append((key, inputs, list(reads)))
        return fn(*inputs)


@pytest.mark.parametrize("max_tokens,capacity,T,want", [
    (128, 8, 100, 128), (128, 8, 128, 128),          # padded to the bucket
    (128, 8, 129, None), (127, 8, 100, None),        # its bucket beyond the limit: launched
    (0, 8, 100, None), (1024, 0, 100, None),         # --graph-tokens 0, no room for a graph
])
def test_the_routing_decision(max_tokens, capacity, T, want):
    assert graph_tokens(CpuOps(), T) is None                          # no head graphs (the CPU)
    ops = CpuOps()
    ops.head_graphs = GraphCache(None, max_tokens=max_tokens, capacity=capacity)
    assert graph_tokens(ops, T) == want


def _stream(p, rng, cu):
    T = int(cu[-1])
    hs = rng.standard_normal((T, p.text.hidden_size)).astype(np.float32)
    return hs, rng.integers(0, p.text.vocab_size, T)


def _bits(z):
    return np.asarray(z, np.float32).view(np.uint32)


def _flat(logits):
    return np.concatenate([z for seq in logits for z in seq])


# the padded head against the exact one on the same stream: the same operations, but the attentions add their
# masked keys' exact zeros and the memory GEMM runs over more rows, so fp32 sums may round in another order: a few
# ulp of the logits (|z| ~ 30 here; 1e-5 relative is some 80 ulp of fp32), far below any answer's resolution
REORDERED = dict(rtol=1e-5, atol=1e-5)


def test_heads_go_through_the_cache_with_the_schema_as_key(gold_params):
    p, rng = gold_params, np.random.default_rng(7)
    ops = CpuOps()
    ops.head_graphs = rec = _Recording(max_tokens=1024)
    for cu, qs in (BASE, SHIFTED):
        hs, ids = _stream(p, rng, cu)
        want = heads(CpuOps(), p, hs, ids, cu, qs)
        got = heads(ops, p, hs, ids, cu, qs)
        key, inputs, reads = rec.calls[-1]
        assert key == (HeadLayout(cu, qs, ops.token_block, 128).key, ops.plan)
        assert inputs[0].shape == (128, p.text.hidden_size) and np.array_equal(inputs[0][:cu[-1]], hs)
        assert not np.any(inputs[0][cu[-1]:])                          # zero pad rows
        assert inputs[2].dtype == np.int64 and inputs[1].shape == (16, p.text.hidden_size)
        assert len(reads) == len(p.head) and all(any(r is w for w in p.head.values()) for r in reads)
        np.testing.assert_allclose(_flat(got), _flat(want), **REORDERED)
    assert rec.calls[0][0] == rec.calls[1][0]                          # one key for both states
    # a graph is kept per plan (the range-safe fallback runs other kernels): the keys of two plans differ
    assert (key[0], Plan("fp16")) != (key[0], Plan("split", range_safe=True))
    ops.head_graphs = rec = _Recording(max_tokens=100)                 # its bucket too large: never offered
    heads(ops, p, *_stream(p, rng, BASE[0]), *BASE)
    assert rec.calls == []


def _inputs(ops, p, lay, hs, ids, pad=0.0):
    """What heads() hands a graph of ``lay``: the states padded (with ``pad``), the LM-head rows, the table."""
    padded = np.full((lay.tokens, hs.shape[1]), pad, np.float32)
    padded[:hs.shape[0]] = hs
    return padded, ops.gather_rows(p.lm_head, lay.option_tokens(ids)), lay.table


PAIRS = {
    "state lengths": (BASE, SHIFTED),
    "no padding and some": ((SAME_SCHEMA["no padding at all"]["cu"], SAME_SCHEMA["no padding at all"]["qs"]), BASE),
    "one sequence": (([0, 300], [BASE[1][0]]), ([0, 260], [_shifted(BASE[1][0], 200)])),
}


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_a_graph_of_one_layout_computes_another_of_its_key(gold_params, name):
    """A replay in numpy: the head run with layout a's shapes (the closure a graph captured on a) on b's inputs
    gives b's own padded result, bit for bit, and that is b's exact head within fp32 reordering."""
    p, rng, ops = gold_params, np.random.default_rng(11), CpuOps()
    (cu_a, qs_a), (cu_b, qs_b) = PAIRS[name]
    tokens = -(-int(cu_b[-1]) // BUCKET) * BUCKET
    a, b = HeadLayout(cu_a, qs_a, 0, tokens), HeadLayout(cu_b, qs_b, 0, tokens)
    assert a.key == b.key
    hs, ids = _stream(p, rng, cu_b)
    replayed = head_module._head(ops, p, a, *_inputs(ops, p, b, hs, ids))
    own = head_module._head(ops, p, b, *_inputs(ops, p, b, hs, ids))
    np.testing.assert_array_equal(_bits(replayed), _bits(own))
    exact = HeadLayout(cu_b, qs_b, 0)
    want = head_module._head(ops, p, exact, hs, ops.gather_rows(p.lm_head, exact.option_tokens(ids)), exact.table)
    np.testing.assert_allclose(own, want, **REORDERED)


def test_without_padding_the_padded_head_is_the_exact_one_bit_for_bit(gold_params):
    """One sequence of a whole bucket: nothing padded, every key range the whole stream: the same operations on
    the same values as the exact layout's (the GPU's padded against exact layouts rests on this)."""
    p, rng, ops = gold_params, np.random.default_rng(5), CpuOps()
    cu, qs = [0, 256], [_shifted(BASE[1][0], 100)]
    hs, ids = _stream(p, rng, cu)
    want = heads(ops, p, hs, ids, cu, qs)
    ops.head_graphs = _Recording(max_tokens=1024)
    got = heads(ops, p, hs, ids, cu, qs)
    assert ops.head_graphs.calls
    np.testing.assert_array_equal(_bits(_flat(got)), _bits(_flat(want)))


@pytest.mark.parametrize("stream", [BASE, SHIFTED], ids=["base", "shifted"])
def test_pad_rows_never_reach_a_value(gold_params, stream):
    """NaN, infinite or huge pad rows: the same logits, bit for bit, and finite."""
    p, rng, ops = gold_params, np.random.default_rng(2), CpuOps()
    cu, qs = stream
    lay = HeadLayout(cu, qs, 0, 128)
    hs, ids = _stream(p, rng, cu)
    want = head_module._head(ops, p, lay, *_inputs(ops, p, lay, hs, ids))
    assert np.all(np.isfinite(want))
    for pad in (np.nan, np.inf, -3e38):
        got = head_module._head(ops, p, lay, *_inputs(ops, p, lay, hs, ids, pad))
        np.testing.assert_array_equal(_bits(got), _bits(want))


class _Traced:
    """CpuOps whose op calls are written down: each op's name and its arguments' shapes and dtypes (arrays) or
    values (numbers, None): the launches a GPU would make, as far as the model decides them."""

    def __init__(self):
        self._ops, self.calls = CpuOps(), []

    def __getattr__(self, name):
        attr = getattr(self._ops, name)
        if not callable(attr):
            return attr

        def call(*args):
            self.calls.append((name, _described(args)))
            return attr(*args)
        return call


def _described(x):
    if isinstance(x, np.ndarray):
        return ("array", x.shape, str(x.dtype))
    if isinstance(x, (tuple, list)):
        return tuple(_described(v) for v in x)
    return x if x is None or isinstance(x, (int, float, str, np.number)) else type(x).__name__


def _trace(p, lay, hs, ids):
    ops = _Traced()
    head_module._head(ops, p, lay, *_inputs(ops._ops, p, lay, hs, ids))
    return ops.calls


def test_the_op_calls_and_shapes_are_the_keys_alone(gold_params):
    """Every op the head calls, in order, with the same shapes for two layouts of one key (the attentions with no
    host groups: nothing planned on positions); for their exact layouts they differ."""
    p, rng = gold_params, np.random.default_rng(3)
    (cu_a, qs_a), (cu_b, qs_b) = BASE, SHIFTED
    ta = _trace(p, HeadLayout(cu_a, qs_a, 0, 128), *_stream(p, rng, cu_a))
    tb = _trace(p, HeadLayout(cu_b, qs_b, 0, 128), *_stream(p, rng, cu_b))
    assert ta == tb and len(ta) > 50
    assert all(call[1][-2] is None for call in ta if call[0] == "mha")  # no host groups
    ea = _trace(p, HeadLayout(cu_a, qs_a, 0), *_stream(p, rng, cu_a))
    eb = _trace(p, HeadLayout(cu_b, qs_b, 0), *_stream(p, rng, cu_b))
    assert ea != eb


def test_the_readouts_indices(gold_params):
    """HeadIndex.local: an exact layout's (each head row's index in its token block) reads the rows
    HeadReadout.add would pick; a padded layout's picks every head row from the whole stream, the same rows."""
    p, rng = gold_params, np.random.default_rng(3)
    cu, qs = BASE
    hs, _ = _stream(p, rng, cu)
    for block in (0, 16, 17, 64):
        ops = CpuOps()
        ops.token_block = block
        lay = HeadLayout(cu, qs, block)
        got = readout(ops, p, hs, lay.rows, lay.views(lay.table).local)
        want = readout(ops, p, hs, head_rows(cu, qs))
        assert np.array_equal(got.picked, want.picked) and np.array_equal(got.mem, want.mem)
        padded = HeadLayout(cu, qs, block, 128)
        x = np.concatenate([hs, np.full((28, hs.shape[1]), np.nan, np.float32)])
        seen = padded_readout(ops, p, x, padded, padded.views(padded.table))
        assert np.array_equal(seen.picked, want.picked[np.searchsorted(want.rows, padded.rows)])
        assert seen.mem.shape == (128, want.mem.shape[1]) and np.all(np.isfinite(seen.mem))
        np.testing.assert_allclose(seen.mem[:100], want.mem, rtol=1e-6, atol=1e-6)   # a GEMM of more rows


def test_the_cuda_attentions_launches_depend_on_shapes_alone():
    """Head.mha on a numpy stand-in, its batched products recorded: with the table's group ids alone (a
    padded layout) the products' shapes are the same for other ids of the same lengths, and the result is the
    masked attention's (each query over its own group's keys only, against cpu.mha per group); with host groups
    the key ranges follow the ids."""
    rng = np.random.default_rng(4)
    W, heads_n, n, m = 16, 2, 7, 40
    w = [rng.standard_normal(s).astype(np.float32) * 0.3 for s in ((3 * W, W), (3 * W,), (W, W), (W,))]
    xq, xkv = rng.standard_normal((n, W)).astype(np.float32), rng.standard_normal((m, W)).astype(np.float32)
    products = []
    fake = types.SimpleNamespace(ctx=types.SimpleNamespace(cp=np, upload=np.asarray),
                                 matmul=types.SimpleNamespace(
                                     linear=cpu.linear, bmm=lambda a, b: products.append((a.shape, b.shape)) or a @ b))
    layouts = [(np.array([0, 0, 0, 1, 1, 1, 1]), np.repeat([0, 1, 2], [10, 20, 10])),
               (np.array([0, 0, 0, 0, 0, 0, 1]), np.repeat([0, 1, 2], [30, 5, 5]))]
    shapes, planned = [], []
    for gq, gk in layouts:
        products.clear()
        out = Head.mha(fake, xq, xkv, *w, heads_n, None, (gq, gk))
        shapes.append(list(products))
        for g in (0, 1):
            want = cpu.mha(xq[gq == g], xkv[gk == g], *w, heads_n)
            np.testing.assert_allclose(out[gq == g], want, rtol=1e-5, atol=1e-5)   # fp32, another order
        products.clear()
        Head.mha(fake, xq, xkv, *w, heads_n, (gq, gk), (gq, gk))
        planned.append(list(products))
    d = W // heads_n
    assert shapes[0] == shapes[1] == [((heads_n, n, d), (heads_n, d, m)), ((heads_n, n, m), (heads_n, m, d))]
    assert planned[0] != planned[1]


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


def test_the_segment_softmax_runs_one_kernel(monkeypatch):
    """The per-question softmax sum is one launch of the deterministic kernel (never a scatter with atomics)."""
    launched = []

    class Kernel:
        def __call__(self, scores, values, owner, n, width, out):
            launched.append((scores.shape, values.shape, owner.dtype, int(n), int(width), out.shape))
            return out

    monkeypatch.setattr("clefcore.backends.cuda.head.segment_softmax_sum_k", Kernel)
    fake = types.SimpleNamespace(ctx=types.SimpleNamespace(cp=np, f32=lambda x: np.asarray(x, np.float32),
                                                           contiguous=np.ascontiguousarray, asarray=np.asarray))
    Head.segment_softmax_sum(fake, np.zeros(5, np.float32), np.zeros((5, 3), np.float32),
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
