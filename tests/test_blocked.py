"""Token-blocked prefill (clefcore/model/backbone.py) equals the unblocked computation, blocks cutting
sequences at awkward places; the ops that carry state across a block boundary on their own too."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from clefcore.backends import cpu
from clefcore.backends.cpu import CpuOps
from clefcore.checkpoint import Checkpoint
from clefcore.model.backbone import _conv_tail, backbone, block_plan
from clefcore.model.params import load_params

from gpu_only import HAVE_GPU

GOLD = Path(__file__).parent / "golden" / "model"
RNG = np.random.default_rng(11)


def r(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def _stream(lengths, vocab):
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = RNG.integers(0, vocab, int(cu[-1]))
    pos = np.concatenate([np.arange(n) for n in lengths]).astype(np.int64)
    return ids, cu, pos


# ------------------------------------------------------------------------------------------------ the plan

def test_block_plan():
    plan = block_plan(np.array([0, 5, 5, 12, 20]), 20, 6)
    assert [(b.t0, b.t1) for b in plan] == [(0, 6), (6, 12), (12, 18), (18, 20)]
    assert [list(b.cu) for b in plan] == [[0, 5, 6], [0, 6], [0, 6], [0, 2]]
    assert [(b.cont_in, b.cont_out) for b in plan] == [(False, True), (True, False), (False, True), (True, False)]


# --------------------------------------------------------------------------------------------- single ops

@pytest.mark.parametrize("lengths", [[70], [3, 70, 1, 64], [130, 65]])
@pytest.mark.parametrize("block", [1, 17, 64, 65])
def test_attention_query_offset(lengths, block):
    T, hq, hkv, d = sum(lengths), 4, 2, 16
    q, k, v = r(T, hq, d), r(T, hkv, d), r(T, hkv, d)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    want = cpu.attention(q, k, v, cu, 0.25)
    kc, vc = cpu.kv_cache(T, hkv, d), cpu.kv_cache(T, hkv, d)
    kc[:] = np.nan                                   # rows beyond the current block must never be read
    vc[:] = np.nan
    for t0 in range(0, T, block):
        t1 = min(t0 + block, T)
        cpu.kv_write(kc, t0, k[t0:t1])
        cpu.kv_write(vc, t0, v[t0:t1])
        got = cpu.attention(q[t0:t1], kc, vc, cu, 0.25, q_offset=t0)
        np.testing.assert_allclose(got, want[t0:t1], rtol=0, atol=2e-6)


@pytest.mark.parametrize("block", [1, 2, 3, 5, 64])
def test_conv_with_previous_rows(block):
    x, w = r(70, 6), r(6, 4)
    want = cpu.conv1d_silu(x, w, np.array([0, 70]))
    prev = None
    for t0 in range(0, 70, block):
        xb = x[t0:t0 + block]
        got = cpu.conv1d_silu(xb, w, np.array([0, len(xb)]), prev=prev)
        np.testing.assert_allclose(got, want[t0:t0 + block], rtol=0, atol=1e-6)
        prev = _conv_tail(np, prev, xb, 0, 3)


# ------------------------------------------------------------------------------------------- whole model

CASES = [
    ([150], [1, 2, 63, 64, 65, 149]),
    ([70, 3, 1, 100, 64, 5], [1, 7, 64, 65, 128]),   # several sequences per block and cut ones
]


@pytest.mark.parametrize("lengths,blocks", CASES)
def test_backbone_blocked_equals_unblocked_cpu(gold_params, lengths, blocks):
    p = gold_params
    ids, cu, pos = _stream(lengths, p.text.vocab_size)
    want, want_layers = backbone(CpuOps(), p, ids, cu, pos, keep_layers=True)
    scale = float(np.max(np.abs(want)))
    for block in blocks:
        got, layers = backbone(CpuOps(), p, ids, cu, pos, keep_layers=True, block=block)
        err = float(np.max(np.abs(got - want))) / scale
        assert err <= 2e-5, f"block {block}: final states differ by {err:.2e} (relative)"
        for i, (a, b) in enumerate(zip(layers, want_layers)):
            e = float(np.max(np.abs(a - b))) / float(np.max(np.abs(b)))
            assert e <= 2e-5, f"block {block}, layer {i}: {e:.2e}"


def test_keep_layers_are_copies(gold_params):
    """kept streams are snapshots (the residual stream is updated in place), the last one before the final
    norm."""
    p = gold_params
    ids, cu, pos = _stream([40], p.text.vocab_size)
    hs, layers = backbone(CpuOps(), p, ids, cu, pos, keep_layers=True, block=16)
    assert len(layers) == p.text.num_layers
    assert not any(np.shares_memory(a, b) for a in layers for b in layers if a is not b)
    np.testing.assert_allclose(cpu.rmsnorm(layers[-1], p.norm, p.text.rms_eps), hs, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device visible to CuPy")
@pytest.mark.parametrize("lengths,blocks", CASES)
def test_backbone_blocked_equals_unblocked_gpu(gold_params, lengths, blocks):
    from clefcore.backends.cuda import CudaOps
    # the exact path: blocking is precision-independent logic, and fast's fp16 rounding of every GEMM input would
    # take most of the bound below whenever blocks change a GEMM's row count (and with it the autotuned path)
    ops = CudaOps(0, precision="exact")
    p = load_params(Checkpoint(GOLD), ops)
    ids, cu, pos = _stream(lengths, p.text.vocab_size)
    ref, _ = backbone(CpuOps(), gold_params, ids, cu, pos)
    want, want_layers = backbone(ops, p, ids, cu, pos, keep_layers=True, block=0)
    want = ops.to_host(want)
    scale = float(np.max(np.abs(ref)))
    print(f"BLOCKED gpu unblocked vs cpu {float(np.max(np.abs(want - ref))) / scale:.2e}")
    for block in blocks:
        got, layers = backbone(ops, p, ids, cu, pos, keep_layers=True, block=block)
        got = ops.to_host(got)
        err = float(np.max(np.abs(got - want))) / scale
        err_ref = float(np.max(np.abs(got - ref))) / scale
        print(f"BLOCKED gpu {lengths} block {block}: vs unblocked gpu {err:.2e}, vs cpu {err_ref:.2e}")
        # GEMM paths may differ by M (autotune per M bucket, cuBLAS algorithms): fp16-operand rounding level
        assert err <= 5e-3 and err_ref <= 2e-2, f"block {block}: {err:.2e} / {err_ref:.2e}"
