"""The joint head as a CUDA graph keyed on its question schema (clefcore/model/head.py, CudaOps.head_graphs,
clefcore/backends/cuda/head.py) on the tiny golden model.

The graph's key is the stream's question schema and its token count rounded up to 128; every position is data in
its index table. So requests of one schema whose states differ in length, as a client sends them, replay one graph.

Bit for bit, not within a tolerance: a replay runs the very kernels that the head on the padded layout runs
eagerly, on the same inputs (the graph's static buffers hold copies of them), so every logit must carry the same
bits. The reference is that eager head of each stream on its own (``_eager``: a cache that has seen nothing, where
every key is a first sighting): a capture and every replay, of any stream of the key, must equal it. Against the
exact layout (``_exact``: what runs beyond the graphs' token limit) the logits are the same bits where the stream
needs no padding (a whole number of 128-token buckets); padding adds masked keys' zeros to the attentions' sums,
within fp32 reordering (tests/test_head_layout.py checks the same in numpy). The batched product is CuPy's
matmul's own cuBLAS call, bit for bit, and the per-question softmax sum the same bits run after run.

Needs a GPU; the keys, the tables, the routing, a numpy model of a replay and of the segment kernel are checked
without one (tests/test_head_layout.py).
"""

from __future__ import annotations

import types
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from clefcore import answers, precision
from clefcore.backends import cpu
from clefcore.backends.cpu import CpuOps
from clefcore.checkpoint import Checkpoint
from clefcore.model import head as head_module
from clefcore.model.head import HeadLayout, heads
from clefcore.model.params import load_params

from gpu_only import MARKS, NEEDS_CUBLAS, reseed

pytestmark = MARKS
GOLD = Path(__file__).parent / "golden" / "model"
RNG = np.random.default_rng()
BUCKET = 128


@pytest.fixture(autouse=True)
def _seeded(request):
    reseed(RNG, request)


@pytest.fixture(scope="module")
def gpu():
    from clefcore.backends.cuda import CudaOps
    ops = CudaOps(0)
    return ops, load_params(Checkpoint(GOLD), ops)


def q(span, options, type_index):
    return types.SimpleNamespace(question_span=span, option_spans=tuple(options), type_index=type_index)


def _questions(L, kinds):
    """Questions laid out left to right from token 2 of an L-token sequence: ``kinds`` = (options, type) each; a
    question span of 1-4 tokens, options of 1-3 tokens, gaps of 0-2."""
    t, qs = 2, []
    for n_opts, type_index in kinds:
        span = (t, t + int(RNG.integers(1, 5)))
        t = span[1]
        opts = []
        for _ in range(n_opts):
            opts.append((t, t + int(RNG.integers(1, 4))))
            t = opts[-1][1]
        t += int(RNG.integers(0, 3))
        qs.append(q(span, opts, type_index))
    assert t < L - 1, "the test's sequence is too short for its questions"
    return qs


def _states(ops, p, cu):
    T = int(cu[-1])
    return ops.asarray(RNG.standard_normal((T, p.text.hidden_size)).astype(np.float32)), \
        RNG.integers(0, p.text.vocab_size, T)


def _stream(ops, p, seqs):
    """A packed stream: ``seqs`` = (length, kinds) per sequence -> (hs on the device, ids, cu_seqlens, questions)."""
    cu = np.concatenate([[0], np.cumsum([L for L, _ in seqs])]).astype(np.int64)
    qs = [_questions(L, kinds) for L, kinds in seqs]
    return (*_states(ops, p, cu), cu, qs)


def _longer(ops, p, s, grow):
    """The same schema after states ``grow[b]`` tokens longer in each sequence b: every question and option span
    and every sequence bound moved, fresh states and tokens (a client's next request)."""
    _, _, cu, qs = s
    cu2 = np.concatenate([[0], np.cumsum(np.diff(cu) + np.asarray(grow))]).astype(np.int64)
    qs2 = [[q((x.question_span[0] + g, x.question_span[1] + g), [(a + g, b + g) for a, b in x.option_spans],
              x.type_index) for x in seq] for g, seq in zip(grow, qs)]
    return (*_states(ops, p, cu2), cu2, qs2)


def _growths(s):
    """Two ways to lengthen the states of ``s`` within its bucket: every sequence a little, the first by all the
    room there is."""
    _, _, cu, _ = s
    B, T = len(cu) - 1, int(cu[-1])
    room = -(-T // BUCKET) * BUCKET - T
    assert room > 0, "the test's stream fills its bucket: no room to move it"
    return [[room // B] * B, [room] + [0] * (B - 1)]


def _key(ops, s):
    _, _, cu, qs = s
    return HeadLayout(cu, qs, ops.token_block, ops.head_graphs.padded_tokens(int(cu[-1]))).key


def _head(ops, p, s):
    hs, ids, cu, qs = s
    return heads(ops, p, hs, ids, cu, qs)


def _eager(ops, p, s):
    """The head of ``s`` on its padded layout, run eagerly: through a cache that has seen nothing, so its
    key is a first sighting. What a capture and a replay must reproduce."""
    from clefcore.backends.cuda.graphs import GraphCache
    saved = ops.head_graphs
    ops.head_graphs = GraphCache(ops.ctx, saved.max_tokens, saved.capacity, saved.bucket)
    try:
        return _head(ops, p, s)
    finally:
        ops.head_graphs = saved


def _bits(logits):
    return np.concatenate([z for seq in logits for z in seq]).astype(np.float32).view(np.uint32)


def _same(got, want):
    np.testing.assert_array_equal(_bits(got), _bits(want))


@contextmanager
def _exact(ops):
    """The exact layout's launches from Python: a head graph cache of no tokens (--graph-tokens 0), the same
    kernels and the GEMM autotune's choices."""
    from clefcore.backends.cuda.graphs import GraphCache
    saved = ops.head_graphs
    ops.head_graphs = GraphCache(ops.ctx, 0, saved.capacity, saved.bucket)
    try:
        yield
    finally:
        ops.head_graphs = saved


TWO = [(2, 0), (2, 1), (2, 2)]                  # every question with two options: sums the same in any order
MANY = [(7, 1), (2, 0), (10, 2), (3, 1)]
LAYOUTS = {
    "two options": [(120, TWO)],
    "many options": [(300, MANY)],
    "one question": [(41, [(2, 0)])],
    "255 options": [(900, [(255, 1)])],
    "packed": [(100, TWO), (57, [(3, 2)]), (163, MANY)],
    "packed two options": [(90, TWO), (61, [(2, 1), (2, 0)])],
}


def _counts(ops):
    return ops.head_graphs.captures, ops.head_graphs.launches


def test_the_backend_makes_the_cache(gpu):
    from clefcore.backends.cuda.ops import HEAD_GRAPHS
    ops, _ = gpu
    assert ops.head_graphs.max_tokens == ops.graphs.max_tokens and ops.head_graphs.capacity == HEAD_GRAPHS
    assert ops.head_graphs.bucket == ops.graphs.bucket == BUCKET


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_first_sight_capture_and_replays_equal_the_eager_head_bit_for_bit(gpu, name):
    """A stream seen once runs eagerly, twice is captured, then replays; so do the streams of its schema whose
    states are longer (within the bucket): each replays the one graph and equals its own eager head."""
    ops, p = gpu
    s = _stream(ops, p, LAYOUTS[name])
    want = _eager(ops, p, s)
    c0, l0 = _counts(ops)
    _same(_head(ops, p, s), want)                                  # first sight: launched
    assert _counts(ops) == (c0, l0)
    _same(_head(ops, p, s), want)                                  # captured, then launched as a graph
    assert _counts(ops) == (c0 + 1, l0 + 1)
    _same(_head(ops, p, s), want)                                  # replayed
    assert _counts(ops) == (c0 + 1, l0 + 2)
    for grow in _growths(s):                                       # the same schema, other states
        s2 = _longer(ops, p, s, grow)
        assert _key(ops, s2) == _key(ops, s)
        want2 = _eager(ops, p, s2)
        _same(_head(ops, p, s2), want2)
        assert not np.array_equal(_bits(want2), _bits(want))
    assert _counts(ops) == (c0 + 1, l0 + 4)
    assert ops.memory_in_use() >= ops.head_graphs.nbytes() > 0


def test_a_clients_requests_with_other_state_lengths_replay_one_graph(gpu):
    """Production's traffic: one schema, each request's state of another length, packed with others or alone.
    The second request captures, every later one replays, whatever its length within the bucket, and each gives
    its own eager head's bits."""
    ops, p = gpu
    first = _stream(ops, p, [(150, MANY), (40, TWO)])              # 190 tokens: the 256 bucket
    series = [first] + [_longer(ops, p, first, g) for g in ([2, 3], [30, 0], [0, 66], [17, 9], [1, 1], [50, 16])]
    assert len({_key(ops, s) for s in series}) == 1
    assert len({tuple(s[2]) for s in series}) == len(series)       # every sequence bound moved at least once
    c0, l0 = _counts(ops)
    for i, s in enumerate(series):
        want = _eager(ops, p, s)
        _same(_head(ops, p, s), want)
        assert _counts(ops) == (c0 + (i >= 1), l0 + max(0, i))     # eager, captured (and launched), replays


@pytest.mark.parametrize("seqs", [[(128, TWO)], [(70, TWO), (58, [(2, 1), (2, 0)])], [(256, [(2, 0)])]],
                         ids=["two options", "packed two options", "one question"])
def test_the_graph_equals_the_exact_layout_bit_for_bit_without_padding(gpu, seqs):
    """Where the stream fills its buckets, the graph changes no bit of any logit, hence of any probability:
    nothing padded, every attention over the whole stream in both."""
    ops, p = gpu
    s = _stream(ops, p, seqs)
    with _exact(ops):
        want = _head(ops, p, s)
    for _ in range(3):                                             # launched, captured, replayed
        got = _head(ops, p, s)
        _same(got, want)
        for a, b in zip((z for seq in got for z in seq), (z for seq in want for z in seq)):
            assert np.array_equal(answers.softmax(a), answers.softmax(b))


@pytest.mark.parametrize("seqs", [LAYOUTS["packed"], [(130, TWO)]], ids=["packed", "one sequence"])
def test_the_graph_against_the_numpy_head(gpu, seqs):
    """A replay against the fp32 numpy head (exact layout) on the same states: within the precision mode's
    contract (fast: 1e-2 in probability; the head's GEMMs round their activations to fp16 there)."""
    ops, p = gpu
    s = _stream(ops, p, seqs)
    for _ in range(3):
        got = _head(ops, p, s)
    hs, ids, cu, qs = s
    p_cpu = load_params(Checkpoint(GOLD), CpuOps())
    want = heads(CpuOps(), p_cpu, ops.to_host(hs), ids, cu, qs)
    bound = precision.VERIFY_BOUND[ops.mode][1]
    worst = max(float(np.max(np.abs(answers.softmax(a) - answers.softmax(b))))
                for ga, wa in zip(got, want) for a, b in zip(ga, wa))
    print(f"head graph vs numpy: worst probability difference {worst:.2e} (bound {bound})")
    assert worst <= bound


def test_pad_rows_never_reach_a_result(gpu, monkeypatch):
    """The states' pad rows filled with NaN before the eager run, the capture and every replay: the logits of
    zero padding, bit for bit, and finite (the graph zeroes them itself; no index picks them; the attentions mask
    them)."""
    ops, p = gpu
    s = _stream(ops, p, LAYOUTS["packed"])                         # 320 tokens: 64 pad rows
    others = [_longer(ops, p, s, g) for g in _growths(s)]
    wants = [_eager(ops, p, x) for x in [s] + others]
    pad = head_module._pad_rows

    def nan_padded(ops_, hs, tokens):
        out = pad(ops_, hs, tokens)
        out[hs.shape[0]:] = np.nan
        return out

    monkeypatch.setattr(head_module, "_pad_rows", nan_padded)
    c0, l0 = _counts(ops)
    for x, want in [(s, wants[0])] * 3 + list(zip(others, wants[1:])):
        got = _head(ops, p, x)
        assert all(np.all(np.isfinite(z)) for seq in got for z in seq)
        _same(got, want)
    assert _counts(ops) == (c0 + 1, l0 + 4)                        # eager, captured, replays: NaN each time


def test_a_replay_after_another_schema(gpu):
    ops, p = gpu
    a, b = _stream(ops, p, [(130, MANY)]), _stream(ops, p, [(70, TWO), (71, [(4, 1)])])
    a2 = _longer(ops, p, a, [40])
    want_a, want_b, want_a2 = _eager(ops, p, a), _eager(ops, p, b), _eager(ops, p, a2)
    c0, l0 = _counts(ops)
    for s, want in ((a, want_a), (a, want_a), (b, want_b), (b, want_b), (a2, want_a2), (b, want_b), (a, want_a)):
        _same(_head(ops, p, s), want)
    assert _counts(ops) == (c0 + 2, l0 + 5)


def _changed(qs, seq, i, **changes):
    out = [list(x) for x in qs]
    old = out[seq][i]
    out[seq][i] = q(changes.get("span", old.question_span), changes.get("options", old.option_spans),
                    changes.get("type_index", old.type_index))
    return out


def test_a_changed_schema_never_replays_another_schemas_graph(gpu):
    """Same sequences, same numbers of questions and options: one option span a token longer, one question's type,
    one question span a token longer; and the same schema with its states grown past the bucket. Each is a key of
    its own: launched at first sight, never a replay of the graph captured for the first."""
    ops, p = gpu
    s = _stream(ops, p, [(110, MANY), (90, TWO)])
    hs, ids, cu, qs = s
    for _ in range(2):
        _head(ops, p, s)                                           # the first schema's graph, captured
    q0 = qs[0][0]
    (o0, o1), rest = q0.option_spans[-1], q0.option_spans[:-1]
    qa, qb = q0.question_span
    moved = [q((x.question_span[0] + 1, x.question_span[1] + 1), [(a + 1, b + 1) for a, b in x.option_spans],
               x.type_index) for x in qs[0][1:]]
    variants = [(cu, [[q(q0.question_span, list(rest) + [(o0, o1 + 1)], q0.type_index)] + moved, qs[1]]),
                (cu, _changed(qs, 1, 2, type_index=(qs[1][2].type_index + 1) % 3)),
                (cu, [[q((qa, qb + 1), [(a + 1, b + 1) for a, b in q0.option_spans], q0.type_index)] + moved, qs[1]]),
                _longer(ops, p, s, [57, 0])[2:]]                  # 257 tokens: the next bucket
    for cu2, qs2 in variants:
        s2 = (*_states(ops, p, cu2), cu2, qs2)
        assert _key(ops, s2) != _key(ops, s)
        want = _eager(ops, p, s2)
        c0, l0 = _counts(ops)
        _same(_head(ops, p, s2), want)
        assert _counts(ops) == (c0, l0)                            # launched: no graph of another schema


def test_the_cache_keeps_at_most_its_capacity(gpu):
    ops, p = gpu
    cache = ops.head_graphs
    saved, cache.capacity = cache.capacity, 2
    try:
        streams = [_stream(ops, p, [(100 + BUCKET * i, TWO)]) for i in range(3)]   # three buckets: three keys
        wants = [_eager(ops, p, s) for s in streams]
        for s, want in zip(streams, wants):
            for _ in range(2):
                _same(_head(ops, p, s), want)                      # each captured: the oldest falls out at the third
        assert len(cache._graphs) == 2
        c0, l0 = _counts(ops)
        _same(_head(ops, p, streams[2]), wants[2])                 # kept: replayed
        assert _counts(ops) == (c0, l0 + 1)
        _same(_head(ops, p, streams[0]), wants[0])                 # dropped: captured again
        assert _counts(ops) == (c0 + 1, l0 + 2) and len(cache._graphs) == 2
    finally:
        cache.capacity = saved


def test_captures_that_come_with_the_traffic_hold_no_more_memory(gpu):
    """Every schema seen twice is captured, and the cache keeps the last few: forty more captures past a full
    cache leave the device's memory beyond the cache's own graphs where it was (nothing a capture makes, such as
    a library's per-stream workspace, may pile up; 4 MiB of slack, two of the arenas' granules). In CuPy pools
    they did not: about 1 MiB of each dropped graph's pool of small cudaMallocs was not given back to the device
    (docs/bench/2026-12-07-h100-op-objects), which is why each graph's memory is one arena."""
    import cupy
    ops, p = gpu
    cache = ops.head_graphs

    def used_beyond_the_cache():
        cupy.get_default_memory_pool().free_all_blocks()
        free, total = cupy.cuda.runtime.memGetInfo()
        return total - free - cache.nbytes()

    def capture(kinds):                                            # one schema each: options counted apart
        for k in kinds:
            s = _stream(ops, p, [(700, [k])])
            for _ in range(3):
                _head(ops, p, s)

    capture([(2 + i, 2) for i in range(cache.capacity)])          # the cache full
    before, c0 = used_beyond_the_cache(), cache.captures
    capture([(2 + i, 1) for i in range(40)])
    assert cache.captures == c0 + 40
    grown = used_beyond_the_cache() - before
    print(f"40 captures past a full cache: {grown / 2 ** 20:.1f} MiB beyond the cache's graphs")
    assert grown <= 4 << 20


@pytest.mark.parametrize("limit", [259, 300])
def test_a_stream_whose_bucket_is_too_large_runs_its_launches(gpu, limit):
    """260 tokens pad to 384: beyond a limit of 259 or 300, the exact layout's launches from Python."""
    ops, p = gpu
    cache = ops.head_graphs
    s = _stream(ops, p, [(260, TWO)])
    saved, cache.max_tokens = cache.max_tokens, limit
    try:
        with _exact(ops):
            want = _head(ops, p, s)
        c0, l0 = _counts(ops)
        for _ in range(3):
            _same(_head(ops, p, s), want)
        assert _counts(ops) == (c0, l0)
    finally:
        cache.max_tokens = saved


def test_a_replaced_weight_is_never_replayed_stale(gpu):
    ops, p = gpu
    s = _stream(ops, p, [(150, MANY)])
    for _ in range(3):
        before = _head(ops, p, s)
    name = "question_projection.weight"
    saved = p.head[name]
    p.head[name] = saved * 2                                       # another array: the graph must not run
    try:
        want = _eager(ops, p, s)
        assert not np.array_equal(_bits(want), _bits(before))
        c0, l0 = _counts(ops)
        _same(_head(ops, p, s), want)
        assert _counts(ops) == (c0, l0)
    finally:
        p.head[name] = saved
    for _ in range(3):                                             # the weights back: the answers of before
        _same(_head(ops, p, s), before)


def test_the_range_safe_plan_has_graphs_of_its_own(gpu):
    ops, p = gpu
    s = _stream(ops, p, [(140, MANY)])
    for _ in range(3):
        _head(ops, p, s)
    with ops.fallback():
        want = _eager(ops, p, s)
        c0, l0 = _counts(ops)
        _same(_head(ops, p, s), want)                              # first sight under this plan: launched
        assert _counts(ops) == (c0, l0)
        for _ in range(2):
            _same(_head(ops, p, s), want)
        assert _counts(ops) == (c0 + 1, l0 + 2)


def test_an_upload_inside_a_capture_fails_it_and_runs_eagerly(gpu):
    """A host array uploaded inside a captured function would be a copy from a staging buffer gone by the replay:
    the capture fails (logged) and that key runs eagerly from then on, with the right answer."""
    ops, _ = gpu
    cache = ops.head_graphs
    x = ops.asarray(np.arange(4, dtype=np.float32))

    def fn(a):
        return a + ops.asarray(np.full(4, 2.0, np.float32))

    c0, l0 = _counts(ops)
    for _ in range(3):
        np.testing.assert_array_equal(ops.to_host(cache.run(("upload test",), fn, (x,), ())), [2, 3, 4, 5])
    assert _counts(ops) == (c0, l0)


def _one_bucket(items, count, n):
    """``n`` of ``items`` whose ``count`` (tokens) round up to one bucket, all different counts where there are."""
    items = sorted(items, key=count)
    for a in range(len(items) - n + 1):
        window = items[a:a + n]
        if (count(window[0]) - 1) // BUCKET == (count(window[-1]) - 1) // BUCKET:
            return window
    raise AssertionError("no states of the test's making fall within one bucket")


def test_the_engine_replays_the_head_across_state_lengths_and_answers_the_same(gpu):
    """Engine.forward (the backbone's graph, the head's, the reserved arena) on one client's requests: the same
    questions, states of other lengths, alone and packed in pairs. From the third forward of the schema and
    bucket on, the head replays; each forward's logits equal the eager head on that forward's own
    states, bit for bit, and so do the answers."""
    import clefcore
    from clefcore.example_request import support_ticket
    engine = clefcore.load(GOLD, device="cuda", context_length=2048)
    engine.reserve(1024, 2)
    ops, p = engine.ops, engine.params
    prepared = [engine.prepare(support_ticket(state="Checkout fails" + " again" * k + ".")) for k in range(40)]
    tokens = lambda batch: sum(x.num_tokens for x in batch)                       # noqa: E731
    for batches in (_one_bucket([[x] for x in prepared], tokens, 4),
                    _one_bucket([[a, b] for a, b in zip(prepared, prepared[3:])], tokens, 4)):
        assert len({tokens(b) for b in batches}) == 4
        for i, batch in enumerate(batches):
            records = [x.record for x in batch]
            launched = ops.head_graphs.launches
            logits, hs, _ = engine.forward(records)
            if i >= 2:                                             # by the third forward of the key: a replay
                assert ops.head_graphs.launches == launched + 1
            cu = np.concatenate([[0], np.cumsum([len(r.input_ids) for r in records])])
            ids = np.concatenate([r.input_ids for r in records])
            want = _eager(ops, p, (hs, ids, cu, [r.questions for r in records]))
            _same(logits, want)
            for x, got_z, want_z in zip(batch, logits, want):
                assert (answers.response(x.request, x.record, got_z, engine.confidence)
                        == answers.response(x.request, x.record, want_z, engine.confidence))


# ------------------------------------------------------------------------------------------------ the two ops

@NEEDS_CUBLAS
@pytest.mark.parametrize("h,n,k,m", [(1, 1, 1, 1), (4, 1, 8, 1), (16, 63, 64, 65), (3, 300, 8, 17),
                                     (16, 7, 64, 1024)])
def test_the_batched_product_is_cupys_matmul_bit_for_bit(gpu, h, n, k, m):
    """The head's product (cuBLAS through ctypes, callable in a capture) against CuPy's matmul on the same
    operands, contiguous and as the head's transposed views."""
    import cupy
    ops, _ = gpu
    a = cupy.asarray(RNG.standard_normal((n, h, k)).astype(np.float32)).transpose(1, 0, 2)
    b = cupy.asarray(RNG.standard_normal((m, h, k)).astype(np.float32)).transpose(1, 2, 0)
    for x, y in ((a, b), (cupy.ascontiguousarray(a), cupy.ascontiguousarray(b))):
        got = ops.matmul.bmm(x, y)
        want = cupy.matmul(x, y)
        np.testing.assert_array_equal(ops.to_host(got).view(np.uint32), ops.to_host(want).view(np.uint32))


@pytest.mark.parametrize("width", [1, 63, 65, 1024])
@pytest.mark.parametrize("sizes", [[2], [1, 2, 2, 1], [3], [2, 0, 7, 255, 1], [0, 4]])
def test_the_segment_kernel(gpu, width, sizes):
    """clef_segment_softmax_sum against its numpy twin: the same order of additions, so the two differ only by
    their exp (CUDA's expf within 2 ulp, numpy's within 1) and the roundings that follow from it: at most
    (8 + 4 n) 2^-24 of sum |w v| per value for a group of n rows. Deterministic (two runs, the same bits); an
    empty group: zeros."""
    ops, _ = gpu
    owner = np.repeat(np.arange(len(sizes)), sizes)
    n = len(owner)
    sc = (RNG.standard_normal(n) * 4).astype(np.float32)
    vals = RNG.standard_normal((n, width)).astype(np.float32)
    got = ops.to_host(ops.segment_softmax_sum(ops.asarray(sc), ops.asarray(vals), owner, len(sizes)))
    again = ops.to_host(ops.segment_softmax_sum(ops.asarray(sc), ops.asarray(vals), ops.asarray(owner), len(sizes)))
    np.testing.assert_array_equal(got.view(np.uint32), again.view(np.uint32))
    want = cpu.segment_softmax_sum(sc, vals, owner, len(sizes))
    m = np.full(len(sizes), -np.inf, np.float32)
    np.maximum.at(m, owner, sc)
    e = np.exp(sc - m[owner])
    den = np.zeros(len(sizes), np.float32)
    np.add.at(den, owner, e)
    mass = np.zeros((len(sizes), width))
    np.add.at(mass, owner, np.abs((e / den[owner])[:, None] * vals))
    bound = (8 + 4 * np.asarray(sizes, float))[:, None] * 2.0 ** -24 * mass
    assert np.all(np.abs(got.astype(np.float64) - want) <= bound)
    assert not np.any(got[np.asarray(sizes) == 0])


def test_bench_breakdown_times_the_head_over_a_clients_series(tmp_path):
    """`clefcore bench --breakdown N`: the breakdown's timed runs, a series of the case's schema with other state
    lengths in its bucket, every one a replay of the head's graph (single and packed), timed apart from the
    backbone."""
    import json
    from clefcore import bench
    report = tmp_path / "bench.json"
    assert bench.main(["--model", str(GOLD), "--precision", "fast", "--lengths", "200", "--packed", "2x160",
                       "--reps", "2", "--no-kernels", "--no-transformers", "--breakdown", "400",
                       "--json", str(report)]) == 0
    got = json.loads(report.read_text())
    for case in got["end_to_end"]["fast"]:
        parts = case["breakdown"]
        T = case["tokens"]
        assert len(parts["series_tokens"]) == 2 and all((T - 1) // 128 == (t - 1) // 128 and t < T
                                                        for t in parts["series_tokens"]), parts
        assert parts["head_graph_replays"] == 2 and case["cuda_graph"], case
        assert 0 < parts["head_launch_ms"] <= parts["head_ms"] and parts["backbone_ms"] > 0, parts
