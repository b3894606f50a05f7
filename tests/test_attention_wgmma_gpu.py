"""The Hopper causal attention (cuda/attention_wgmma.cu, what kernel_select.causal_attention picks on compute
capability 9.0) on the GPU, under the fast and the exact plans, beyond the op table's rows (tests/test_ops.py: the
numpy attention on the fp16 cache, token-blocked prefill, other head ratios): on awkward lengths, packed sequences
and clef-flash's GQA ratio (16 query heads on 4 K/V heads, head dim 256) against attention.cu's kernel (what every
other GPU runs) on the same inputs, whose error it must not exceed; long sequences; and the cases
causal_attention leaves on attention.cu (bit-identical to it).
Needs compute capability 9.0 running native code (the kernel's body is built for sm_90a only).

Tolerance: 4e-3 of max |ref|, tests/test_ops.py's bound for the fp16 attention (q, K, V and P rounded to fp16,
11 significant bits each, fp32 sums: well under 3e-3 on random data). The reference is given the fp16 cache's
values, which is what both kernels read. Both kernels make the same roundings (q and P to fp16, fp32 scores,
max, sum and rescale, exp2 of the scaled scores, 64-key tiles from the sequence's start), so they differ only in
the order of the fp32 sums of the tensor cores, which moves a probability across an fp16 rounding boundary now
and then: the new kernel's error may exceed the old one's by a quarter at most (on the H200 the two are expected
to agree far closer; the bound is what "not worse" means here)."""


import numpy as np
import pytest

from clefcore.backends import cpu
from clefcore import kernel_select
from clefcore.kernel_select import ATTN, ATTN_WGMMA, causal_attention

from gpu_only import MARKS, reseed

pytestmark = MARKS
cupy = pytest.importorskip("cupy")

RNG = np.random.default_rng()
TOL = 4e-3
NOT_WORSE = 1.25
D, HQ, HKV = 256, 16, 4          # clef-flash's full-attention layers


@pytest.fixture(autouse=True)
def _seeded(request):
    reseed(RNG, request)


class AttentionCu:
    """A backend whose causal attention runs attention.cu's kernel (causal_attention's other answer, every other GPU's
    kernel): its attention calls run with the selector answering ATTN; everything else is the backend's."""

    def __init__(self, ops):
        self.ops = ops

    def __getattr__(self, name):
        return getattr(self.ops, name)

    def attention(self, *args, **kwargs):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(kernel_select, "causal_attention", lambda *a: ATTN)
            return self.ops.attention(*args, **kwargs)


@pytest.fixture(scope="module", params=["fast", "exact"])
def pair(request):
    """(attention_wgmma.cu, attention.cu) backends under one precision mode."""
    from clefcore.backends.cuda import CudaOps
    on = CudaOps(0, precision=request.param)
    if causal_attention(on.ctx.setting, D, True) is not ATTN_WGMMA:
        pytest.skip(f"attention_wgmma.cu runs on compute capability 9.0 only ({on.ctx.device_name} is "
                    f"{on.ctx.cc[0]}.{on.ctx.cc[1]})")
    return on, AttentionCu(CudaOps(0, precision=request.param))


def r(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def rel(got, ref):
    got = np.asarray(got, np.float64)
    assert got.shape == ref.shape and np.all(np.isfinite(got)), "non-finite output (a row unwritten or NaN read)"
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


def inputs(T, hq=HQ, hkv=HKV):
    """fp32 q (the engine's), the fp16 cache's K and V, and the reference's fp32 copies of the cache's values."""
    q, k16, v16 = r(T, hq, D), r(T, hkv, D).astype(np.float16), r(T, hkv, D).astype(np.float16)
    return q, k16, v16, k16.astype(np.float32), v16.astype(np.float32)


def run(ops, q, k16, v16, cu, scale, q_offset=0):
    return ops.to_host(ops.attention(ops.asarray(q), cupy.asarray(k16), cupy.asarray(v16), cu, scale,
                                     q_offset=q_offset))


def test_hopper_routes_to_the_wgmma_kernel(pair):
    on, off = pair
    q, k16, v16, _, _ = inputs(70)
    for ops in pair:
        run(ops, q, k16, v16, np.array([0, 70]), 0.0625)
    assert ("attention_wgmma.cu", "attn_wgmma_fwd_d256") in on.ctx.caches.functions
    assert not any(f == "attention_wgmma.cu" for f, _ in off.ctx.caches.functions)


CU = [[0, 1], [0, 63], [0, 65], [0, 127], [0, 129], [0, 1000],
      [0, 1, 64, 129, 259], [0, 65, 130, 131], [0, 127, 256, 257, 1000], [0, 300, 428, 429, 557]]


@pytest.mark.parametrize("cu", CU)
def test_against_numpy_and_attention_cu(pair, cu):
    on, off = pair
    cu = np.array(cu)
    q, k16, v16, k, v = inputs(int(cu[-1]))
    scale = D ** -0.5
    ref = cpu.attention(q, k, v, cu, scale)
    e_on = rel(run(on, q, k16, v16, cu, scale), ref)
    e_off = rel(run(off, q, k16, v16, cu, scale), ref)
    print(f"ERR attn_wgmma cu{list(cu)} {e_on:.3e} (attention.cu {e_off:.3e})")
    assert e_on <= TOL
    assert e_on <= NOT_WORSE * e_off + 1e-7, (e_on, e_off)


def test_long_sequence_last_rows(pair):
    """8,192 tokens (128 key tiles for the last block, both K/V buffers reused 64 times): the last and the first
    queries against numpy."""
    on, off = pair
    T, last = 8192, 16
    cu = np.array([0, T])
    q, k16, v16, k, v = inputs(T)
    got = run(on, q, k16, v16, cu, 1 / 16)
    assert rel(got[T - last:], cpu.attention(q[T - last:], k, v, cu, 1 / 16, q_offset=T - last)) <= TOL
    assert rel(got[:130], cpu.attention(q[:130], k[:130], v[:130], np.array([0, 130]), 1 / 16)) <= TOL
    assert rel(got, run(off, q, k16, v16, cu, 1 / 16)) <= TOL


def test_more_tiles_than_grid_y(pair):
    """65,537 one-token sequences: two launches (gridDim.y's 65,535); a lone key gets all the weight, so each
    output row is its value row, exactly."""
    on, _ = pair
    T = 65537
    q, k16, v16, _, v = inputs(T, 2, 1)
    got = run(on, q, k16, v16, np.arange(T + 1), 0.25)
    assert np.array_equal(got, np.repeat(v, 2, axis=1))


@pytest.mark.parametrize("case", ["fp32 K/V", "head dim 128"])
def test_unrouted_cases_are_bit_identical(pair, case):
    """Where causal_attention keeps attention.cu (K/V not fp16, a head dim without a wgmma kernel) the result is
    attention.cu's, bit for bit."""
    on, off = pair
    cu = np.array([0, 65, 200])
    d = 128 if case == "head dim 128" else D
    q, k, v = r(200, HQ, d), r(200, HKV, d), r(200, HKV, d)
    if case == "head dim 128":
        k, v = k.astype(np.float16), v.astype(np.float16)
    a = on.to_host(on.attention(on.asarray(q), cupy.asarray(k), cupy.asarray(v), cu, 0.0625))
    b = off.to_host(off.attention(off.asarray(q), cupy.asarray(k), cupy.asarray(v), cu, 0.0625))
    assert np.array_equal(a, b)
