"""Engine.reserve (clefcore/backends/cuda/reserve.py): nothing on the CPU, the synthetic work it sizes with,
its procedure on a bookkeeping arena; on a GPU, traffic after it takes nothing from CuPy's pool, answers
unchanged."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import clefcore
from clefcore import pool
from clefcore.backends.cuda import reserve as R
from clefcore.backends.cuda.state import Caches
from clefcore.engine import padded
from clefcore.errors import DeviceError
from clefcore.example_request import support_ticket

from golden_requests import GOLD, accepted
from gpu_only import HAVE_GPU

LIMITS = dict(batch_tokens=1024, batch_requests=4, chunk_tokens=256)


@pytest.mark.parametrize("tokens", [1, 300, 1001])
def test_padded_lengthens_the_state_only(engine, tokens):
    base = engine.prepare(support_ticket())
    p = padded(base, tokens)
    r, b = p.record, base.record
    assert p.num_tokens == max(tokens, base.num_tokens)
    extra = p.num_tokens - base.num_tokens
    s0, s1 = b.state_span
    assert r.state_span == (s0, s1 + extra)
    assert np.array_equal(r.input_ids[:s0], b.input_ids[:s0])
    assert np.array_equal(r.input_ids[s1 + extra:], b.input_ids[s1:])     # the questions' tokens, unchanged
    for q, bq in zip(r.questions, b.questions):
        assert np.array_equal(r.input_ids[slice(*q.question_span)], b.input_ids[slice(*bq.question_span)])
        for o, bo in zip(q.option_spans, bq.option_spans):
            assert np.array_equal(r.input_ids[slice(*o)], b.input_ids[slice(*bo)])
    out = engine.infer([p])[0]                        # a well-formed decision
    assert list(out["answers"]) == list(support_ticket()["questions"])


def test_the_cpu_reserves_nothing(engine):
    assert engine.reserve(**LIMITS) == 0
    assert engine.status().backend.get("reserved_bytes", 0) == 0


def answer_numbers(answers) -> np.ndarray:
    """Every probability in a list of answers (each a question's dict), in order."""
    out = []
    for a in answers:
        out += list(a.get("probabilities", {}).values()) or [a["noul"]]
    return np.array(out, dtype=np.float64)


def _traffic(engine):
    """Batches, single prompts and a chunked prompt with a batch between its steps; every probability."""
    prepared = accepted(engine)
    out = [engine.infer(prepared[:4]), engine.infer(prepared[:1]), engine.infer(prepared[:1])]
    long = padded(engine.prepare(support_ticket()), 2000)
    run = engine.chunked(long, LIMITS["chunk_tokens"])
    while not run.step():
        out.append(engine.infer(prepared[1:3]))
    out.append([run.response()])
    return [a for batch in out for response in batch for a in response["answers"].values()]


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device visible to CuPy")
def test_after_the_reservation_nothing_allocates_and_answers_are_unchanged():
    import cupy
    # one GEMM kernel for both engines (auto would time its own choice per engine)
    ref = clefcore.load(GOLD / "model", "cuda:0", context_length=2048, gemm="wmma")
    want = _traffic(ref)
    engine = clefcore.load(GOLD / "model", "cuda:0", context_length=2048, gemm="wmma")
    reserved = engine.reserve(**LIMITS)
    assert reserved > 0 and engine.status().backend["reserved_bytes"] == reserved
    assert engine.memory_in_use() >= reserved
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    before = pool.total_bytes()
    got = _traffic(engine)
    assert pool.total_bytes() == before           # every forward's buffers came from the arena
    assert engine.status().backend["reserve_overflows"] == 0
    assert len(got) == len(want) > 20
    np.testing.assert_allclose(answer_numbers(got), answer_numbers(want), rtol=1e-6, atol=1e-7)  # same kernels

    # beyond the limits (a batch 4x --max-batch-tokens): answered all the same, from CuPy's pool, and counted
    big = padded(engine.prepare(support_ticket()), LIMITS["batch_tokens"])
    got, want = (answer_numbers(a for r in e.infer([big] * 4) for a in r["answers"].values())
                 for e in (engine, ref))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert engine.status().backend["reserve_overflows"] > 0


# --- reserve.py's procedure on the CPU: clefcore.pool.Arena's bookkeeping (its FreeList) without a device ----

class _BookArena:
    """clefcore.pool.Arena with FreeList ranges for memory: what reserve.py reads of it (capacity, in_use,
    extent, overflows), alloc/give for the fake forwards, activate/deactivate as no-ops."""

    def __init__(self, nbytes, device_id=0, overflow=False):
        self.free, self.overflow, self.overflows, self.overflow_bytes = pool.FreeList(nbytes), overflow, 0, 0

    capacity = property(lambda self: self.free.capacity)
    in_use = property(lambda self: self.free.in_use)
    extent = property(lambda self: self.free.extent)

    def alloc(self, n):
        start = self.free.take(n)
        if start >= 0:
            return (start, n)
        if not self.overflow:
            raise DeviceError(f"arena out of memory: asked for {n} bytes")
        self.overflows, self.overflow_bytes = self.overflows + 1, self.overflow_bytes + n
        return None

    def give(self, piece):
        if piece is not None:
            self.free.give(*piece)

    def activate(self):             # no device: nothing to switch
        pass

    deactivate = activate


class _OutOfMemory(Exception):
    """Stands for cupy.cuda.memory.OutOfMemoryError."""


class _Ops:
    """What reserve.py uses of CudaOps and its device context, with a device of ``free`` bytes."""

    def __init__(self, free):
        pool = SimpleNamespace(free_all_blocks=lambda: None)
        cp = SimpleNamespace(get_default_memory_pool=lambda: pool,
                             cuda=SimpleNamespace(runtime=SimpleNamespace(memGetInfo=lambda: (free, 2 * free)),
                                                  memory=SimpleNamespace(OutOfMemoryError=_OutOfMemory)))
        self.ctx = SimpleNamespace(cp=cp, device_id=0, caches=Caches())
        self.arena = None

    def synchronize(self):
        pass


def _forwards(ops, sizes_per_run, keep=None):
    """A worst case that allocates ``sizes_per_run[i]`` on its i-th run (0: the warm-up, outside any arena),
    freeing every other piece at once (fragmentation) and the rest at the end; ``keep`` holds pieces past it."""
    runs = iter(sizes_per_run)

    def worst_case():
        sizes = next(runs)
        arena = ops.arena
        if arena is None:
            return
        pieces = [arena.alloc(n) for n in sizes]
        for p in pieces[::2]:
            arena.give(p)
        if keep is not None:
            keep.append(pieces.pop())
        for p in pieces[1::2] if keep is None else pieces[1::2][:-1]:
            arena.give(p)
    return worst_case


@pytest.fixture
def book(monkeypatch):
    monkeypatch.setattr(pool, "Arena", _BookArena)


def test_reserve_keeps_the_trials_extent_plus_the_margin(book):
    ops = _Ops(free=8 << 30)
    sizes = [(300 << 20), (5 << 20), (700 << 20), (1 << 20), (40 << 20)]
    got = R.reserve(ops, _forwards(ops, [sizes] * 3))
    need = (300 + 5 + 700 + 1 + 40) << 20          # nothing is freed before the last allocation: all side by side
    assert got is ops.arena and ops.arena.overflow and ops.arena.overflows == 0
    assert got.capacity == -(-int(need * R.MARGIN) // R.GRANULE) * R.GRANULE
    assert ops.arena.in_use == 0


def test_reserve_refuses_a_worst_case_larger_than_the_device(book):
    ops = _Ops(free=R.HEADROOM + (64 << 20))
    with pytest.raises(DeviceError, match=r"needs more than the 67108864 bytes free .*asked for 104857600"):
        R.reserve(ops, _forwards(ops, [[100 << 20]] * 3))
    assert ops.arena is None


def test_reserve_serves_from_the_trial_when_its_memory_outlives_it(book, caplog):
    """A bug (an array of the trial run kept alive) must not stop the server: the trial arena cannot be given
    back, so it becomes the reservation, and the log says so."""
    ops = _Ops(free=1 << 30)
    kept = []
    got = R.reserve(ops, _forwards(ops, [[4 << 20, 1 << 20]] * 3, keep=kept))
    assert got is ops.arena and got.capacity == (1 << 30) - R.HEADROOM and got.in_use == 1 << 20 and kept
    assert "1048576 bytes made while sizing the reservation outlived the run" in caplog.text


def test_reserve_refuses_when_the_kept_arena_overflows(book):
    ops = _Ops(free=1 << 30)
    small, large = [10 << 20], [40 << 20]          # the third run asks for more than the trial did
    with pytest.raises(DeviceError, match=r"ran in 10485760 bytes but not in an arena of 12582912 \(41943040"):
        R.reserve(ops, _forwards(ops, [small, small, large]))
    assert ops.arena is None


WARM_UP = r"out of device memory on the first run, outside any arena \(3221225472 of 6442450944 bytes free"


@pytest.mark.parametrize("error, raised, match", [
    (_OutOfMemory("out of memory allocating 1,073,741,824 bytes"), DeviceError, WARM_UP),
    (RuntimeError("CUBLAS_STATUS_ALLOC_FAILED"), DeviceError, WARM_UP),   # a cuBLAS workspace
    (ValueError("a bug, not a shortage"), ValueError, "a bug"),           # anything else goes through
])
def test_reserve_names_running_out_of_memory_on_the_warm_up(book, error, raised, match):
    """The first run uses CuPy's pool: running out there (or cuBLAS failing to get its workspace) is the same
    refusal as the trial's, with the numbers, never a bare CuPy or cuBLAS error that fails the start unexplained."""
    ops = _Ops(free=3 << 30)

    def worst_case():
        raise error
    with pytest.raises(raised, match=match):
        R.reserve(ops, worst_case)
    assert ops.arena is None


def test_reserve_gives_the_index_tables_an_arena_of_their_own(book):
    ops = _Ops(free=1 << 30)
    ops.ctx.caches.uploads["stale"] = object()       # made before the reservation, in CuPy's pool
    R.reserve(ops, _forwards(ops, [[1 << 20]] * 3))
    assert ops.ctx.caches.uploads == {} and ops.ctx.caches.upload_arena.capacity == R.UPLOADS
