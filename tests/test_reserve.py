"""Engine.reserve: the device memory of the largest batch and chunked prompt a server gives the engine, held
from load on (clefcore/backends/cuda/reserve.py). On the CPU it reserves nothing; the synthetic work it sizes
with (engine.padded) is checked here. On a GPU, after the reservation a server's kind of traffic (packed
batches, single prompts, a chunked prompt with batches between its steps) takes nothing from CuPy's own pool,
and answers as an engine without one."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import clefcore
from clefcore.engine import SELF_CHECK_REQUEST, padded

sys.path.insert(0, str(Path(__file__).parent))
from golden_requests import GOLD, accepted  # noqa: E402
from gpu_only import HAVE_GPU  # noqa: E402

LIMITS = dict(batch_tokens=1024, batch_requests=4, chunk_tokens=256)


@pytest.fixture(scope="module")
def cpu_engine():
    return clefcore.load(GOLD / "model", "cpu", max_length=2048)


@pytest.mark.parametrize("tokens", [1, 300, 1001])
def test_padded_lengthens_the_state_only(cpu_engine, tokens):
    base = cpu_engine.prepare(SELF_CHECK_REQUEST)
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
    out = cpu_engine.infer([p])[0]                    # a well-formed decision
    assert list(out["answers"]) == list(SELF_CHECK_REQUEST["questions"])


def test_the_cpu_reserves_nothing(cpu_engine):
    assert cpu_engine.reserve(**LIMITS) == 0
    assert cpu_engine.status().backend.get("reserved_bytes", 0) == 0


def _numbers(answers) -> np.ndarray:
    """Every probability in a list of answers (each a question's dict), in order."""
    out = []
    for a in answers:
        out += list(a.get("probabilities", {}).values()) or [a["noul"]]
    return np.array(out, dtype=np.float64)


def _traffic(engine):
    """Batches, single prompts and a chunked prompt with a batch between its steps; every probability."""
    prepared = accepted(engine)
    out = [engine.infer(prepared[:4]), engine.infer(prepared[:1]), engine.infer(prepared[:1])]
    long = padded(engine.prepare(SELF_CHECK_REQUEST), 2000)
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
    ref = clefcore.load(GOLD / "model", "cuda:0", max_length=2048, gemm="wmma")
    want = _traffic(ref)
    engine = clefcore.load(GOLD / "model", "cuda:0", max_length=2048, gemm="wmma")
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
    np.testing.assert_allclose(_numbers(got), _numbers(want), rtol=1e-6, atol=1e-7)   # the same kernels

    # beyond the limits (a batch 4x --max-batch-tokens): answered all the same, from CuPy's pool, and counted
    big = padded(engine.prepare(SELF_CHECK_REQUEST), LIMITS["batch_tokens"])
    np.testing.assert_allclose(_numbers(a for r in engine.infer([big] * 4) for a in r["answers"].values()),
                               _numbers(a for r in ref.infer([big] * 4) for a in r["answers"].values()),
                               rtol=1e-6, atol=1e-7)
    assert engine.status().backend["reserve_overflows"] > 0
