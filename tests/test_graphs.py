"""CUDA graphs for short prompts (clefcore/backends/cuda/graphs.py, padding in model/backbone.py): padding
changes no row on the CPU; on a GPU replays match eager runs, and packed or long prompts fall back."""

from __future__ import annotations

import sys
import types
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from clefcore import errors
from clefcore.backends.cpu import CpuOps
from clefcore.backends.cuda.graphs import GraphCache
from clefcore.checkpoint import Checkpoint
from clefcore.model.backbone import backbone
from clefcore.model.params import load_params

from gpu_only import MARKS

GOLD = Path(__file__).parent / "golden" / "model"


class _PadOnly(GraphCache):
    """GraphCache's padding rule without a GPU: pads to the bucket, then runs the layers eagerly."""

    def __init__(self, bucket, max_tokens):
        super().__init__(None, max_tokens=max_tokens, bucket=bucket)
        self.calls = []

    def run(self, key, fn, inputs, reads):
        self.calls.append(key)
        return fn(*inputs)


@pytest.mark.parametrize("T", [1, 63, 64, 65, 100])
def test_padding_to_the_bucket_changes_no_row(gold_params, T):
    p = gold_params
    ids = np.random.default_rng(T).integers(0, p.text.vocab_size, T)
    cu, pos = np.array([0, T]), np.arange(T)
    want, _ = backbone(CpuOps(), p, ids, cu, pos)
    pad = _PadOnly(bucket=64, max_tokens=1024)
    ops = CpuOps()
    ops.graphs = pad
    got, _ = backbone(ops, p, ids, cu, pos)
    assert pad.calls and pad.calls[0][1] == -(-T // 64) * 64
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * float(np.abs(want).max()))


def test_no_padding_for_packed_or_long_prompts():
    pad = _PadOnly(bucket=128, max_tokens=1024)
    got = [pad.padded_length(T, n) for T, n in ((346, 1), (1024, 1), (1025, 1), (346, 2))]
    assert got == [384, 1024, None, None]
    assert _PadOnly(bucket=128, max_tokens=0).padded_length(10, 1) is None


MiB = 1 << 20


class _Stream:
    """What a capture asks of a CuPy stream, with nothing behind it: a context, a capture that records no work."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass

    def begin_capture(self):
        pass

    def end_capture(self):
        return types.SimpleNamespace(upload=lambda stream: None, launch=lambda stream: None)


class _FakeArena:
    """clefcore.pool.Arena's bookkeeping without a device: a bump allocator that raises ArenaFull past capacity."""
    made = []

    def __init__(self, nbytes, device_id=0):
        if nbytes > 64 * MiB:
            raise errors.DeviceError(f"arena: cannot reserve {nbytes} bytes")
        self.capacity, self.extent = nbytes, 0
        _FakeArena.made.append(nbytes)

    def total_bytes(self):
        return self.capacity

    def malloc(self, n):
        if self.extent + n > self.capacity:
            raise errors.ArenaFull(f"arena out of memory: asked for {n} bytes")
        self.extent += n
        return n


def _arena_cache(monkeypatch):
    """A GraphCache whose CuPy is a stand-in and whose arenas are _FakeArena: fn(nbytes)
    allocates nbytes from whatever allocator is active, as an op does inside a capture."""
    active = []

    @contextmanager
    def using_allocator(malloc):
        active.append(malloc)
        try:
            yield
        finally:
            active.pop()

    cuda = types.SimpleNamespace(Stream=lambda non_blocking: _Stream(), using_allocator=using_allocator,
                                 get_current_stream=_Stream)
    ctx = types.SimpleNamespace(cp=types.SimpleNamespace(cuda=cuda, copyto=lambda dst, src: None),
                                device_id=0, watched=[], pinned=None)
    monkeypatch.setitem(sys.modules, "clefcore.pool", types.SimpleNamespace(Arena=_FakeArena))
    _FakeArena.made = []

    def fn(x):
        return active[-1](int(x.sum())) if active else None
    return GraphCache(ctx, max_tokens=1024, capacity=4), fn


def test_a_graph_arena_is_found_by_doubling_then_cut_to_the_graphs_need(monkeypatch):
    cache, fn = _arena_cache(monkeypatch)
    five = np.array([5 * MiB])
    for _ in range(2):                                     # seen, then captured
        cache.run("five", fn, [five], ())
    # 2 and 4 MiB run out, 8 MiB holds it; 5 MiB with the 5 % margin is 6 MiB in whole 2 MiB granules
    assert _FakeArena.made == [2 * MiB, 4 * MiB, 8 * MiB, 6 * MiB]
    assert cache.nbytes() == 6 * MiB and cache.captures == 1
    one = np.array([1 * MiB])
    for _ in range(2):
        cache.run("one", fn, [one], ())
    # the next trial starts at the largest need so far, not at the doubling's 8 MiB
    assert _FakeArena.made[4:] == [6 * MiB, 2 * MiB]
    assert cache.nbytes() == 8 * MiB and cache.captures == 2


def test_a_graph_no_arena_can_hold_runs_eagerly_and_sizes_no_later_trial(monkeypatch):
    cache, fn = _arena_cache(monkeypatch)
    huge = np.array([100 * MiB])
    for _ in range(3):
        cache.run("huge", fn, [huge], ())
    assert _FakeArena.made == [2 * MiB << i for i in range(6)]   # up to 64 MiB, then the device says no
    assert cache.captures == 0 and cache.nbytes() == 0 and "huge" in cache._failed
    one = np.array([1 * MiB])
    for _ in range(2):
        cache.run("one", fn, [one], ())
    assert _FakeArena.made[6:] == [2 * MiB] and cache.captures == 1   # its trial is the need so far, 2 MiB


# ------------------------------------------------------------------------------------------------- GPU

@pytest.fixture(scope="module")
def gpu():
    from clefcore.backends.cuda import CudaOps
    ck = Checkpoint(GOLD)
    ops = CudaOps(0, graph_tokens=256)
    return ck, ops, load_params(ck, ops)


def _eager_padded(ops, p, ids, bucket):
    """The same padded prompt with graphs off: what a replay must reproduce."""
    T = len(ids)
    Tp = -(-T // bucket) * bucket
    idp = np.concatenate([ids, np.zeros(Tp - T, ids.dtype)])
    keep = ops.graphs.max_tokens
    ops.graphs.max_tokens = 0
    try:
        h, _ = backbone(ops, p, idp, np.array([0, Tp]), np.arange(Tp))
    finally:
        ops.graphs.max_tokens = keep
    return ops.to_host(h)[:T]


def _run(ops, p, ids):
    h, _ = backbone(ops, p, ids, np.array([0, len(ids)]), np.arange(len(ids)))
    return ops.to_host(h)


def _same(got, want):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * float(np.abs(want).max()))


@pytest.mark.parametrize("_", [pytest.param(0, marks=MARKS)])
def test_replay_equals_eager_and_takes_fresh_inputs(gpu, _):
    ck, ops, p = gpu
    g = ops.graphs
    rng = np.random.default_rng(5)
    a, b = rng.integers(0, ck.text.vocab_size, 100), rng.integers(0, ck.text.vocab_size, 97)
    c = rng.integers(0, ck.text.vocab_size, 150)                    # another bucket (256)
    want_a, want_b, want_c = (_eager_padded(ops, p, x, g.bucket) for x in (a, b, c))
    caps, launches = g.captures, g.launches
    _same(_run(ops, p, a), want_a)                                 # first sight: eager
    _same(_run(ops, p, a), want_a)                                 # capture + launch
    assert (g.captures, g.launches) == (caps + 1, launches + 1)
    _same(_run(ops, p, c), want_c)                                 # eager (first sight of its bucket)
    _same(_run(ops, p, b), want_b)                                 # same bucket as a: replay, new tokens
    _same(_run(ops, p, c), want_c)                                 # capture for 256
    _same(_run(ops, p, a), want_a)                                 # a's graph again, after b's inputs
    assert (g.captures, g.launches) == (caps + 2, launches + 4)
    assert ops.memory_in_use() >= g.nbytes() > 0


@pytest.mark.parametrize("_", [pytest.param(0, marks=MARKS)])
def test_guard_fires_inside_a_replay(gpu, _):
    ck, ops, p = gpu
    ids = np.random.default_rng(9).integers(0, ck.text.vocab_size, 40)
    _run(ops, p, ids)
    _run(ops, p, ids)                                              # graph for this bucket exists now
    launches = ops.graphs.launches
    w = p.layers[1]["mlp.down_proj.weight"]
    saved = w.copy()
    w.fill(0)                                                      # the graph reads this address
    try:
        with pytest.raises(errors.DeviceError, match="layer 1 MLP output"):
            _run(ops, p, ids)
        assert ops.graphs.launches == launches + 1
    finally:
        w[...] = saved
    _run(ops, p, ids)                                              # healthy again


@pytest.mark.parametrize("_", [pytest.param(0, marks=MARKS)])
def test_packed_and_long_prompts_stay_eager(gpu, _):
    ck, ops, p = gpu
    launches = ops.graphs.launches
    rng = np.random.default_rng(2)
    ids = rng.integers(0, ck.text.vocab_size, 300)                 # beyond graph_tokens=256
    for _ in range(3):
        _run(ops, p, ids)
    lens = [40, 60]
    cu = np.array([0, 40, 100])
    pid = rng.integers(0, ck.text.vocab_size, 100)
    pos = np.concatenate([np.arange(n) for n in lens])
    for _ in range(3):
        backbone(ops, p, pid, cu, pos)
    assert ops.graphs.launches == launches


@pytest.mark.parametrize("_", [pytest.param(0, marks=MARKS)])
def test_a_replaced_weight_is_never_replayed_stale(gpu, _):
    ck, ops, p = gpu
    ids = np.random.default_rng(4).integers(0, ck.text.vocab_size, 30)
    want = _run(ops, p, ids)
    _run(ops, p, ids)                                              # captured with the original arrays
    L = p.layers[2]
    saved = L["mlp.down_proj.weight"]
    L["mlp.down_proj.weight"] = saved * 0                          # another array: the graph must not run
    try:
        with pytest.raises(errors.DeviceError, match="layer 2 MLP output"):
            _run(ops, p, ids)
    finally:
        L["mlp.down_proj.weight"] = saved
    for _ in range(3):                                             # eager, capture, replay: all as before
        _same(_run(ops, p, ids), want)
