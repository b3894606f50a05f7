"""The Hopper attention kernel (cuda/attention_wgmma.cu) on the CPU: the routing decision
(kernel_select.causal_attention and its one caller) and a numpy model of the kernel
(tests/attn_wgmma_model.py: its shared-memory layouts and descriptors, its tiling, masking and roundings)
against the numpy attention. The kernel itself runs in test_attention_wgmma_gpu.py."""

import types

import numpy as np
import pytest

from clefcore.backends import cpu
from clefcore.backends.cuda.attention import Attention
from clefcore.kernel_select import ATTN, ATTN_WGMMA, Device, Setting, causal_attention
from clefcore.precision import TABLE

import attn_wgmma_model as model
from gpu_only import reseed

RNG = np.random.default_rng()


@pytest.fixture(autouse=True)
def _seeded(request):
    reseed(RNG, request)


# ------------------------------------------------------------------------------------------------ routing

def test_causal_kernels_only_on_hopper_itself():
    """test_kernel_select's table holds every other condition (cc 7.0 .. 9.0, native or PTX, D, K/V dtype); the
    sm_90a body runs on cc 9.0 alone, not on the GPUs after it."""
    for cc in ((10, 0), (12, 0)):
        s = Setting(TABLE["fp16"], frozenset(), Device(cc, True, 232448, True))
        assert causal_attention(s, 256, True) is ATTN, cc


def _routed(cc=(9, 0), ptx70=False, D=256, kv=np.float16):
    """The kernels Attention.attention hands to run_kernel, on a stand-in for the device (no GPU)."""
    seen = {}

    def run(q, k, v, cu, scale, t0, causal, kernels):
        seen.update(kernels=kernels, causal=causal, t0=t0, rows=k.shape[0])

    ops = types.SimpleNamespace(ctx=types.SimpleNamespace(setting=Setting(TABLE["fp16"], frozenset(),
                                                                          Device(cc, not ptx70, 232448, True))),
                                run_kernel=run)
    q = np.zeros((5, 4, D), np.float32)
    k = np.zeros((12, 1, D), kv)
    Attention.attention(ops, q, k, k.copy(), np.array([0, 12]), 0.1, q_offset=3)
    assert seen["causal"] and seen["t0"] == 3 and seen["rows"] == 8     # the cache up to the block's end
    return seen["kernels"]


def test_attention_routes_through_causal_kernels():
    assert _routed() is ATTN_WGMMA
    assert _routed(kv=np.float32) is ATTN
    assert _routed(ptx70=True) is ATTN
    assert _routed(cc=(8, 0)) is ATTN
    assert _routed(D=128) is ATTN


# ------------------------------------------------------------------------------------ the kernel's model

@pytest.mark.parametrize("R", [64, 128])
def test_model_descriptors_read_back_what_the_copies_wrote(R):
    """The K-major reads (Q, K) at each panel's k-steps return the columns the copies put there; the MN-major
    read (V) with the panel stride as leading offset returns 16 keys x all 256 columns at each 2048-byte step."""
    x = RNG.standard_normal((R - 3, model.D)).astype(np.float16)         # rows R-3.. zero-filled
    img = model.store(x, R)
    full = np.zeros((R, model.D), np.float32)
    full[:R - 3] = x
    for p in range(model.NP):
        for ks in range(4):
            got = model.read_k_major(img, p * R * model.ROW + ks * 32, R)
            assert np.array_equal(got, full[:, 64 * p + 16 * ks:64 * p + 16 * ks + 16]), (p, ks)
    for kk in range(R // 16):
        got = model.read_mn_major(img, kk * 2048, R * model.ROW, model.D)
        assert np.array_equal(got, full[16 * kk:16 * kk + 16]), kk
    # the 64-row half of a 128-row Q image a warpgroup reads starts 64 rows on
    if R == 128:
        assert np.array_equal(model.read_k_major(img, 64 * model.ROW, 64), full[64:, :16])


def test_model_a_wrong_leading_offset_reads_other_columns():
    """The MN-major leading offset matters: one atom (1024 bytes) instead of the panel stride reads key rows 8..
    of the first panel as columns 64.."""
    x = RNG.standard_normal((64, model.D)).astype(np.float16)
    img = model.store(x, 64)
    got = model.read_mn_major(img, 0, 1024, model.D)
    assert not np.array_equal(got, x[:16].astype(np.float32))


def _check(got, ref, tol=4e-3):
    assert got.shape == ref.shape and np.all(np.isfinite(got)), "a row not written, or a NaN read"
    err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
    assert err <= tol, err
    return err


# cu_seqlens: lengths 1, 63, 65, 127, 129 (each alone and packed), a sequence cut by the 128-row block, 300
CU = [[0, 1], [0, 63], [0, 65], [0, 127], [0, 129], [0, 1, 64, 129, 256, 385], [0, 300]]


# GQA 4 (clef-flash's ratio) everywhere, its 16 / 4 heads on the short cases (the model's CPU time)
@pytest.mark.parametrize("cu,hq,hkv", [(cu, 4, 1) for cu in CU] + [(cu, 16, 4) for cu in CU if cu[-1] <= 130])
def test_model_matches_numpy(cu, hq, hkv):
    """The model, with fp16 q and the fp16 K/V cache the kernel reads, within the fp16 kernels' 4e-3 of the numpy
    attention over the same cache values (tests/test_ops.py: each operand's 11-bit rounding, fp32 sums)."""
    T = cu[-1]
    cu = np.array(cu)
    q = RNG.standard_normal((T, hq, model.D)).astype(np.float32)
    k = RNG.standard_normal((T, hkv, model.D)).astype(np.float16)
    v = RNG.standard_normal((T, hkv, model.D)).astype(np.float16)
    scale = model.D ** -0.5
    _check(model.attention(q, k, v, cu, scale), cpu.attention(q, k.astype(np.float32), v.astype(np.float32), cu,
                                                              scale))


@pytest.mark.parametrize("block,cu", [(1, [0, 3, 70]), (63, [0, 65, 130, 300]), (65, [0, 65, 130, 300]),
                                      (128, [0, 65, 130, 300]), (129, [0, 65, 130, 300])])
def test_model_token_blocks_never_read_past_the_block(block, cu):
    """Token-blocked prefill: queries [t0, t1) against a cache whose rows from t1 on are NaN (not yet written)."""
    cu = np.array(cu)
    T, hq, hkv = int(cu[-1]), 4, 1
    q = RNG.standard_normal((T, hq, model.D)).astype(np.float32)
    k = RNG.standard_normal((T, hkv, model.D)).astype(np.float16)
    v = RNG.standard_normal((T, hkv, model.D)).astype(np.float16)
    ref = cpu.attention(q, k.astype(np.float32), v.astype(np.float32), cu, 1 / 16)
    got = []
    for t0 in range(0, T, block):
        t1 = min(t0 + block, T)
        kc, vc = k.copy(), v.copy()
        kc[t1:] = np.nan
        vc[t1:] = np.nan
        got.append(model.attention(q[t0:t1], kc, vc, cu, 1 / 16, q_offset=t0))
    _check(np.concatenate(got), ref)
