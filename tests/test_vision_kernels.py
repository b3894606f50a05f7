"""The vision tower's CUDA kernels below its Backend ops against their numpy twins (clefcore/backends/cpu.py) on
fresh random inputs: the tanh GELU kernel (Vision.bias_gelu, fp32 out) and bidirectional_attention
(cuda/attention.cu's attn_bidir_d{D}), on packed batches of images of awkward sizes (1 patch, non-multiples of 16,
several images of different sizes), at the vision head dim 72 (clef-flash), 16 (the tiny golden model) and every
other head dim with a kernel; the work-list checks run on the host. The ops themselves (patch_rows,
vision_attention, vision_mlp) are rows of tests/test_ops.py. The GPU tests run for the native NVRTC build and for
the compute_70 PTX JIT-compiled by the driver (the Volta code path).

Tolerances (max |gpu - ref| / max |ref|) as in tests/test_ops.py: attention takes fp16 operands (q, k, v and
the probabilities P each rounded to 11 significant bits, 2^-11 = 4.9e-4 relative) with fp32 accumulation, so its
bound is 4e-3; gelu_tanh is fp32 throughout (only tanhf's last bits differ from numpy's), 1e-6 like the erf
GELU's.
"""

import numpy as np
import pytest

from clefcore.backends import cpu
from clefcore.backends.cuda import compile as C
from clefcore.backends.cuda.attention import BIDIR_DIMS, attention_tiles

from gpu_only import MARKS, reseed

RNG = np.random.default_rng()


@pytest.fixture(autouse=True)
def _seeded(request):
    reseed(RNG, request)


MODES = ["native"] + (["ptx70"] if C.ptx70_available() else [])
ATTN_TOL = 4e-3
# packed images: one patch, under / over one 16-row warp and one 64-row block, several of different sizes
CU = [[0, 1], [0, 63], [0, 65, 65 + 130], [0, 4, 68, 1092], [0, 3, 3, 80]]


def gpu(test):
    for mark in MARKS:
        test = mark(test)
    return test


def r(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def check(name, got, ref, tol):
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    assert np.all(np.isfinite(got)), f"{name}: non-finite output"
    e = float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))
    print(f"ERR {name} {e:.3e}")
    assert e <= tol, f"{name}: max rel error {e:.3e} > {tol}"


def packed(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


# ------------------------------------------------------------------------------------ the work list (host)

@pytest.mark.parametrize("rows", [64, 128])
@pytest.mark.parametrize("lengths", [[1], [63], [65, 130], [4, 64, 1024], [3, 0, 77], [1] * 200,
                                     [4096, 1, 300, 4096]])
def test_bidirectional_tiles(lengths, rows):
    """Every patch row in exactly one tile of its own image, each tile's keys the whole image, longest image
    first (each of its tiles walks all of its keys)."""
    cu = packed(lengths)
    N = int(cu[-1])
    tiles = attention_tiles(cu, 0, N, rows, causal=False)
    assert tiles.dtype == np.int32 and tiles.shape == (sum(-(-n // rows) for n in lengths), 4)
    covered = np.zeros(N, dtype=np.int64)
    seq_of = np.searchsorted(cu, np.arange(N), side="right") - 1
    for s0, s1, q0, q1 in tiles.tolist():
        k = seq_of[q0]
        assert (s0, s1) == (cu[k], cu[k + 1]) and s0 <= q0 < q1 <= s1 and q1 - q0 <= rows
        covered[q0:q1] += 1
    assert np.all(covered == 1), "a patch row in no tile or in two"
    assert np.all(np.diff(tiles[:, 1].astype(np.int64) - tiles[:, 0]) <= 0), "not longest image first"


def test_causal_tiles_unchanged():
    """The causal list (the default) keeps its order by causal reach, which differs from the image order here."""
    cu = packed([130, 100])
    causal = attention_tiles(cu, 0, 230, 64)
    assert [tuple(t) for t in causal.tolist()] == [(0, 130, 128, 130), (0, 130, 64, 128), (130, 230, 194, 230),
                                                   (0, 130, 0, 64), (130, 230, 130, 194)]
    assert attention_tiles(cu, 0, 230, 64, causal=False)[:, 0].tolist() == [0, 0, 0, 130, 130]


# ------------------------------------------------------------------------------------------- on the GPU

@pytest.fixture(scope="module", params=MODES)
def ops(request):
    from clefcore.backends.cuda import CudaOps
    return CudaOps(0, ptx70=request.param == "ptx70")


@gpu
@pytest.mark.parametrize("shape", [(1,), (63,), (65,), (1000, 77)])
def test_gelu_tanh(ops, shape):
    # Below x ~ -3 the result is 0.5 x (1 + tanh(u)) with tanh(u) near -1: the sum cancels, and one ulp of
    # tanhf (CUDA's is within 2 ulp, numpy's another) moves the result by ~3e-8 |x|, i.e. 1.1e-4 of the
    # -9.1e-4 at x = -3.4 that a one-element draw once was. So the error is measured against the inputs' scale
    # (where gelu(x) ~ x), not against an output that cancellation made tiny.
    x = r(*shape, scale=3.0)
    y = ops.xp.empty(shape, dtype=np.float32)
    ops.vision.bias_gelu(ops.asarray(x), None, y)
    got = ops.to_host(y).astype(np.float64)
    ref = cpu.gelu_tanh(x).astype(np.float64)
    assert got.shape == ref.shape and np.all(np.isfinite(got))
    e = np.max(np.abs(got - ref)) / np.max(np.abs(x))
    assert e <= 1e-6, f"gelu_tanh {shape}: max error {e:.3e} of the inputs' scale > 1e-6"


@gpu
@pytest.mark.parametrize("cu", CU)
@pytest.mark.parametrize("heads", [3, 16])
@pytest.mark.parametrize("D", BIDIR_DIMS)
def test_bidirectional_attention(ops, cu, heads, D):
    """q, k, v as the tower passes them: the three [N, heads, D] column blocks of one fused projection, strided
    fp32 views."""
    N = cu[-1]
    qkv = r(N, 3, heads, D)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    d = ops.asarray(qkv)
    cu = np.array(cu)
    got = ops.attn.bidirectional_attention(d[:, 0], d[:, 1], d[:, 2], cu, D ** -0.5)
    check(f"bidirectional D{D} H{heads} cu{list(cu)}", ops.to_host(got),
          cpu.bidirectional_attention(q, k, v, cu, D ** -0.5), ATTN_TOL)


@gpu
@pytest.mark.parametrize("cu,heads", [([0, 2100, 2400], 4), ([0, 4096], 16)])
def test_bidirectional_attention_long(ops, cu, heads):
    """At D = 72, images of many key tiles (the online softmax carried across them); [0, 4096] x 16 heads is one
    1024 x 1024 image of clef-flash's tower."""
    N, D = cu[-1], 72
    q, k, v = r(N, heads, D), r(N, heads, D), r(N, heads, D)
    cu = np.array(cu)
    got = ops.attn.bidirectional_attention(ops.asarray(q), ops.asarray(k), ops.asarray(v), cu, D ** -0.5)
    check(f"bidirectional long D{D} cu{list(cu)}", ops.to_host(got),
          cpu.bidirectional_attention(q, k, v, cu, D ** -0.5), ATTN_TOL)


@gpu
@pytest.mark.parametrize("D", [16, 72])
def test_bidirectional_attention_fp16_inputs(ops, D):
    """fp16 inputs are read as they are, fp32 ones rounded to fp16 (to nearest, as numpy does) first: both give
    the same bits."""
    cu = np.array([0, 65, 195])
    qkv = [r(195, 3, D) for _ in range(3)]
    attention = ops.attn.bidirectional_attention
    want = ops.to_host(attention(*(ops.asarray(a) for a in qkv), cu, D ** -0.5))
    got = ops.to_host(attention(*(ops.asarray(a.astype(np.float16)) for a in qkv), cu, D ** -0.5))
    np.testing.assert_array_equal(got, want)


@gpu
def test_bidirectional_attention_more_tiles_than_grid_y(ops):
    """65,537 one-patch images: more tiles than a grid's y dimension takes (65,535), so two launches. A lone key
    gets all the weight: each output row is its value row (fp16-rounded)."""
    N, heads, D = 65537, 2, 72
    q, k, v = r(N, heads, D), r(N, heads, D), r(N, heads, D)
    got = ops.attn.bidirectional_attention(ops.asarray(q), ops.asarray(k), ops.asarray(v), np.arange(N + 1), 0.25)
    check("bidirectional 65,537 images", ops.to_host(got), v.astype(np.float16).astype(np.float32), 1e-6)


@gpu
@pytest.mark.parametrize("D,Dv", [(40, 40), (20, 20), (8, 8), (72, 64)])
def test_bidirectional_attention_unsupported_dims(ops, D, Dv):
    from clefcore.errors import DeviceError
    q, k, v = r(5, 2, D), r(5, 2, D), r(5, 2, Dv)
    with pytest.raises(DeviceError, match=f"head dim {D} \\(value dim {Dv}\\)"):
        ops.attn.bidirectional_attention(ops.asarray(q), ops.asarray(k), ops.asarray(v), np.array([0, 5]), 0.25)


# fp32 products: the only differences from numpy are summation order and the exponential's last bits
EXACT_TOL = 2e-6


@gpu
@pytest.mark.parametrize("precision", ["split"])
@pytest.mark.parametrize("cu,heads,D", [([0, 1], 3, 16), ([0, 4, 68, 1092], 3, 72), ([0, 63, 191], 16, 72)])
def test_bidirectional_attention_exact(precision, cu, heads, D):
    """The exact modes' vision attention runs on fp32 products (attention.py says why): numpy's numbers to fp32
    rounding, ~1,000x closer than the fp16 kernel's ATTN_TOL."""
    from clefcore.backends.cuda import CudaOps

    exact = CudaOps(0, precision=precision)
    N = cu[-1]
    qkv = r(N, 3, heads, D)
    d = exact.asarray(qkv)
    cu = np.array(cu)
    got = exact.attn.bidirectional_attention(d[:, 0], d[:, 1], d[:, 2], cu, D ** -0.5)
    check(f"bidirectional exact D{D} H{heads} cu{list(cu)}", exact.to_host(got),
          cpu.bidirectional_attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, D ** -0.5), EXACT_TOL)


@gpu
def test_patch_rows_refuses_other_sizes(ops):
    with pytest.raises(ValueError, match="multiples of 32"):
        ops.patch_rows([np.zeros((48, 32, 3), np.uint8)])
