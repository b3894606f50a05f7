"""Every CudaOps op against the fp32 numpy reference (clefcore/backends/cpu.py) on fresh random inputs:
sizes 1, 63, 65, non-multiples of 16, packed batches. Runs for the native NVRTC build and for the compute_70
PTX built by the pip NVRTC 12 and JIT-compiled by the driver (the Volta code path itself).

Tolerances (max |gpu - ref| / max |ref|): ops whose GEMM-like products take fp16 operands with fp32
accumulation see each operand rounded to 11 significant bits (relative 2^-11 = 4.9e-4 per operand); over
sums of K terms with random signs the relative error of the result stays well under 3e-3, so 4e-3 is used
for linear/mlp/attention (where weights here are already fp16-exact, as bf16 checkpoint values are).
Pure fp32 kernels (norms, rotary, conv, gates, the delta rule) differ only by summation order: 1e-5..2e-4.
"""

import sys
import types
from pathlib import Path

import numpy as np
import pytest

from clefcore.bench import kernels as bench_kernels
from clefcore.backends import cpu
from clefcore.kernel_select import MMA_TILES, WGMMA_TILE, GemmRoute, mma_tile
from clefcore.precision import Plan

sys.path.insert(0, str(Path(__file__).parent))
from gpu_only import HAVE_CUBLAS, HAVE_FP8, MARKS, reseed  # noqa: E402

pytestmark = MARKS
cupy = pytest.importorskip("cupy")

RNG = np.random.default_rng()


@pytest.fixture(autouse=True)
def _seeded(request):
    reseed(RNG, request)


def _have_nvrtc12():
    from clefcore.backends.cuda import compile as C
    return C.ptx70_available()


MODES = ["native"] + (["ptx70"] if _have_nvrtc12() else [])


@pytest.fixture(scope="module", params=MODES)
def ops(request):
    from clefcore.backends.cuda import CudaOps
    return CudaOps(0, ptx70=request.param == "ptx70", gemm="wmma", precision="split")


@pytest.fixture(scope="module")
def ops_cublas():
    from clefcore.backends.cuda import CudaOps
    if not HAVE_CUBLAS:
        pytest.skip("cuBLAS cannot be loaded here")
    return CudaOps(0, gemm="cublas", precision="split")


@pytest.fixture(scope="module")
def ops_fast():
    from clefcore.backends.cuda import CudaOps
    return {"wmma16": CudaOps(0, gemm="wmma", precision="fp16"),
            "cublas16": CudaOps(0, gemm="cublas", precision="fp16") if HAVE_CUBLAS else None}


def _path_ops(path, ops, ops_cublas_request, ops_fast):
    """The CudaOps of a GEMM path name (wmma / cublas: split; wmma16 / cublas16: fp16); cuBLAS paths skip where it
    cannot be loaded."""
    if path.startswith("cublas") and not HAVE_CUBLAS:
        pytest.skip("cuBLAS cannot be loaded here")
    if path == "wmma":
        return ops
    return ops_cublas_request.getfixturevalue("ops_cublas") if path == "cublas" else ops_fast[path]


def r(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def h16(a):
    return a.astype(np.float16).astype(np.float32)


def rel(got, ref, floor=0.0):
    """max |got - ref| over max |ref|; ``floor``: the least denominator, for outputs whose size can cancel far
    below that of the operands (fp32-grade error is relative to the operands, not to a cancelled result)."""
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.all(np.isfinite(got)), "non-finite output"
    return float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), floor, 1e-30)) if ref.size else 0.0


def check(name, got, ref, tol, ops=None, floor=0.0):
    e = rel(ops.to_host(got) if ops else got, ref, floor)
    print(f"ERR {name} {e:.3e}")
    assert e <= tol, f"{name}: max rel error {e:.3e} > {tol}"


SIZES = [1, 63, 65, 130]
# split-precision GEMMs (hi + lo fp16 halves of each fp32 activation, fp16-exact weights) are fp32-grade: on the
# H200 at 54dff08 the worst relative errors were 3.8e-6 (linear) and 1.6e-6 (MLP)
SPLIT_TOL = 2e-5


@pytest.mark.parametrize("R", SIZES)
@pytest.mark.parametrize("D", [1, 63, 65, 256, 4096])
def test_norms(ops, R, D):
    x, d, w, z, b = r(R, D), r(R, D), r(D, scale=0.1), r(R, D), r(D)
    check(f"rmsnorm R{R} D{D}", ops.rmsnorm(ops.asarray(x), ops.asarray(w), 1e-6), cpu.rmsnorm(x, w, 1e-6), 2e-5, ops)
    s, y = ops.add_rmsnorm(ops.asarray(x), ops.asarray(d), ops.asarray(w), 1e-6)
    s0, y0 = cpu.add_rmsnorm(x, d, w, 1e-6)
    check("add_rmsnorm.sum", s, s0, 1e-6, ops)
    check("add_rmsnorm.norm", y, y0, 2e-5, ops)
    check("gated_rmsnorm", ops.gated_rmsnorm(ops.asarray(x), ops.asarray(z), ops.asarray(w), 1e-6),
          cpu.gated_rmsnorm(x, z, w, 1e-6), 2e-5, ops)
    check("layernorm", ops.layernorm(ops.asarray(x), ops.asarray(w), ops.asarray(b)), cpu.layernorm(x, w, b), 2e-5, ops)
    check("l2norm", ops.l2norm(ops.asarray(x), 1e-6, 0.25), cpu.l2norm(x, 1e-6, 0.25), 2e-5, ops)


@pytest.mark.parametrize("T", [1, 65])
def test_gated_rmsnorm_on_a_projection_slice(ops, T):
    """z as the model passes it: heads x d columns of a wider fused projection, viewed [T, heads, d]."""
    H, D = 3, 32
    proj, x, w = r(T, 7 + H * D + 5), r(T, H, D), r(D, scale=0.1)
    z = proj[:, 7:7 + H * D].reshape(T, H, D)
    zd = ops.asarray(proj)[:, 7:7 + H * D].reshape(T, H, D)
    assert T == 1 or ops.ctx.row_map(zd)[4] == H, "z was copied instead of read in place"
    got = ops.gated_rmsnorm(ops.asarray(x), zd, ops.asarray(w), 1e-6)
    assert got.shape == (T, H, D)
    check(f"gated_rmsnorm slice T{T}", got, cpu.gated_rmsnorm(x, z, w, 1e-6), 2e-5, ops)


def test_norms_strided_view(ops):
    T, H, D = 65, 3, 32
    qg = r(T, H, 2, D)
    w = r(D, scale=0.1)
    got = ops.rmsnorm(ops.asarray(qg)[:, :, 0], ops.asarray(w), 1e-6)
    check("rmsnorm strided", got, cpu.rmsnorm(qg[:, :, 0], w, 1e-6), 2e-5, ops)
    got = ops.l2norm(ops.asarray(qg)[:, :, 1], 1e-6)
    check("l2norm strided", got, cpu.l2norm(qg[:, :, 1], 1e-6), 2e-5, ops)


@pytest.mark.parametrize("T,H,D", [(1, 3, 32), (65, 3, 32), (33, 2, 1024)])
def test_norms_head_view_of_a_slice(ops, T, H, D):
    """The q/k columns of the conv output viewed [T, H, D]: no single row stride, so the norms read them through
    a token stride and a head stride (norms.cu's row map), in place, on the warp and the block path."""
    proj, w, b = r(T, 5 + H * D + 7), r(D, scale=0.1), r(D)
    x = proj[:, 5:5 + H * D].reshape(T, H, D)
    xd = ops.asarray(proj)[:, 5:5 + H * D].reshape(T, H, D)
    _, _, _, _, heads, _ = ops.ctx.row_map(xd)
    assert T == 1 or heads == H, "the view was copied instead of read in place"
    check(f"l2norm head view T{T}", ops.l2norm(xd, 1e-6, 0.5), cpu.l2norm(x, 1e-6, 0.5), 2e-5, ops)
    check(f"rmsnorm head view T{T}", ops.rmsnorm(xd, ops.asarray(w), 1e-6), cpu.rmsnorm(x, w, 1e-6), 2e-5, ops)
    check(f"layernorm head view T{T}", ops.layernorm(xd, ops.asarray(w), ops.asarray(b)), cpu.layernorm(x, w, b),
          2e-5, ops)
    z = r(T, H, D)
    check(f"gated_rmsnorm head view T{T}", ops.gated_rmsnorm(xd, ops.asarray(z), ops.asarray(w), 1e-6),
          cpu.gated_rmsnorm(x, z, w, 1e-6), 2e-5, ops)


@pytest.mark.parametrize("M", [1, 63, 65, 300])
@pytest.mark.parametrize("N,K", [(16, 64), (65, 40), (1000, 256), (130, 1000)])
@pytest.mark.parametrize("path", ["wmma", "cublas", "wmma16", "cublas16"])
def test_linear(ops, request, ops_fast, M, N, K, path):
    o = _path_ops(path, ops, request, ops_fast)
    x, w, b = r(M, K), h16(r(N, K, scale=K ** -0.5)), r(N)
    W = o.weight(w)
    tol = 4e-3 if path.endswith("16") else SPLIT_TOL     # split: fp32-grade; fp16: one rounding of x
    check(f"linear {path} {M}x{N}x{K}", o.linear(o.asarray(x), W), cpu.linear(x, w), tol, o)
    check(f"linear+bias {path}", o.linear(o.asarray(x), W, o.asarray(b)), cpu.linear(x, w, b), tol, o)


@pytest.mark.parametrize("tile", MMA_TILES, ids=[t[0] for t in MMA_TILES])
@pytest.mark.parametrize("M", [1, 63, 65, 300])
@pytest.mark.parametrize("N,K", [(16, 64), (65, 40), (1000, 256), (130, 1000), (129, 8), (7, 4104)])
def test_gemm_mma(ops_fast, monkeypatch, M, N, K, tile):
    """gemm_mma.cu (sm_80+, native code only), each tile (a GPU with less shared memory per block takes the
    smaller one: the test lowers what this one reports): fp16 operands, so one rounding of x against numpy, as
    the other fp16 paths; rows and columns past a tile, K past a k-tile (the cp.async zero fill, K % 8 == 0), an
    odd N (the scalar stores), with bias and a residual; every output is written (it starts as NaN)."""
    o = ops_fast["wmma16"]
    if mma_tile(o.ctx.caps) is None:
        pytest.skip("gemm_mma.cu needs compute capability 8.0 or newer")
    name, _, _, smem = tile
    if smem > o.ctx.max_smem_optin:
        pytest.skip(f"{name} needs {smem} bytes of shared memory per block; this GPU has {o.ctx.max_smem_optin}")
    monkeypatch.setattr(o.ctx, "max_smem_optin", smem)   # the largest tile that fits is this one (gemm_mma.cu on
    assert o.matmul.mma_tile() == ("gemm_mma.cu", tile)     # Hopper too: no shared memory for gemm_wgmma.cu's)
    check_mma_route(o, "gemm_mma", M, N, K)


def check_mma_route(o, name, M, N, K):
    """The "mma" route's kernel (``Matmul.mma``) against numpy: plain, with bias and residual, and through gemm_with;
    every output is written (it starts as NaN)."""
    cp = o.cp
    x, w, b, res = r(M, K), h16(r(N, K, scale=K ** -0.5)), r(N), r(M, N)
    a16, W = o.ctx.half(o.asarray(x)), cp.asarray(w.astype(np.float16))
    out = cp.full((M, N), np.nan, dtype=cp.float32)
    check(f"{name} {M}x{N}x{K}", o.matmul.mma(a16, W, out), cpu.linear(x, w), 4e-3, o)
    out[...] = np.nan
    check(f"{name}+bias+res {M}x{N}x{K}", o.matmul.mma(a16, W, out, o.asarray(b), o.asarray(res)),
          cpu.linear(x, w, b) + res, 4e-3, o)
    check(f"{name} gemm_with {M}x{N}x{K}", o.gemm_with(GemmRoute.MMA, o.asarray(x), W, cp.empty((M, N), cp.float32)),
          cpu.linear(x, w), 4e-3, o)


@pytest.mark.parametrize("M", [1, 63, 65, 346])
@pytest.mark.parametrize("N,K", [(16, 64), (65, 40), (1000, 256), (130, 1000), (129, 8), (7, 4104), (300, 520)])
def test_gemm_wgmma(ops_fast, M, N, K):
    """gemm_wgmma.cu, the "mma" route on Hopper (sm_90a, native code only), as test_gemm_mma: rows and columns
    past its 128 x 256 tile, K past a 64-deep k-tile (zero-filled copies into the swizzled stages), an odd N,
    bias and a residual, every output written."""
    o = ops_fast["wmma16"]
    if mma_tile(o.ctx.caps) != ("gemm_wgmma.cu", WGMMA_TILE):
        pytest.skip("gemm_wgmma.cu runs on compute capability 9.0 (native code) only")
    check_mma_route(o, "gemm_wgmma", M, N, K)


@pytest.mark.parametrize("path", ["wmma", "cublas"])
def test_linear_model_k(ops, request, path):
    """split GEMMs at the model's widest K (the MLP's down projection, 12,288). Their error is the fp32
    accumulation's (the tensor cores add with truncation) and grows with K: `clefcore bench`'s check measured
    2.8e-5 for wmma split at 2048 x 4096 x 12,288, over the 2e-5 that holds up to K = 4096, so the bound scales
    as K / 4096 (clefcore.bench.kernels.tol_k): 6e-5 here, still well under what a lost lo term would show (the
    fp16 rounding of the activations, ~2e-4)."""
    o = _path_ops(path, ops, request, None)
    M, N, K = 65, 64, 12288
    x, w = r(M, K), h16(r(N, K, scale=K ** -0.5))
    check(f"linear {path} {M}x{N}x{K}", o.linear(o.asarray(x), o.weight(w)), cpu.linear(x, w),
          bench_kernels.tol_k(SPLIT_TOL, K), o)


@pytest.mark.parametrize("M", [1, 3, 16, 17, 63, 64])
@pytest.mark.parametrize("N,K", [(1, 8), (63, 1024), (65, 40), (130, 63), (1000, 256), (17, 1000), (5, 1500),
                                 (5, 4100)])
@pytest.mark.parametrize("aligned", [True, False])
def test_gemm_rows(ops, M, N, K, aligned):
    """gemm_rows.cu (the few-row GEMM on the CUDA cores), both builds: fp32 products, so fp32-grade against numpy
    in every precision mode; the 16-byte loads (K % 8 == 0, aligned operands) and the element loop (K % 8 != 0, or
    operands starting mid-way into a 16-byte word); K over several 512-wide passes, the last one partial (1000,
    1500, 4100); rows past 16 run in further grid rows; the bias is optional; every output is written (it starts as
    NaN)."""
    cp = ops.cp
    x, w, b = r(M, K), h16(r(N, K, scale=K ** -0.5)), r(N)
    w16 = w.astype(np.float16)
    if aligned:
        xd, W = ops.asarray(x), cp.asarray(w16)
    else:                                  # contiguous operands that start mid-way into a 16-byte word
        xd = cp.zeros(M * K + 1, dtype=cp.float32)[1:].reshape(M, K)
        xd[...] = ops.asarray(x)
        W = cp.zeros(N * K + 1, dtype=cp.float16)[1:].reshape(N, K)
        W[...] = cp.asarray(w16)
        assert xd.data.ptr % 16 and W.data.ptr % 16
    out = cp.full((M, N), np.nan, dtype=cp.float32)
    # fp32-grade error is relative to the operands' size (outputs ~1 here), not to a result that cancelled: at
    # 1 x 1 x 8 the one output can land near 0 (the H200 run at 580879e read 1.6e-5 of an output ~1e-2, i.e.
    # ~1.6e-7 absolute, fp32 rounding of eight products)
    check(f"gemm_rows {M}x{N}x{K}", ops.matmul.gemm_rows(xd, W, out), cpu.linear(x, w), 1e-5, ops, floor=1.0)
    out[...] = np.nan
    check(f"gemm_rows+bias {M}x{N}x{K}", ops.matmul.gemm_rows(xd, W, out, ops.asarray(b)), cpu.linear(x, w, b), 1e-5,
          ops, floor=1.0)


@pytest.mark.parametrize("M", [1, 63, 65])
@pytest.mark.parametrize("N,K", [(1, 4096), (4, 63), (15, 65), (32, 8)])
def test_linear_small_fp32_weight(ops, M, N, K):
    """Matrices with a side under 16 stay fp32 and run as a reduction (capturable in a CUDA graph)."""
    x, w, b = r(M, K), r(N, K, scale=K ** -0.5), r(N)
    W = ops.weight(w)
    assert W.dtype == np.float32 if min(N, K) < 16 else W.dtype == np.float16
    # each output is a sum of K products with unit variance overall, so 1 is its size: with M = N = 1 the one
    # output can land near 0 (1x1x4096 failed at 1.0e-5 of a small |ref| on the H200), which says nothing of
    # the kernel's fp32 error
    check(f"linear fp32 {M}x{N}x{K}", ops.linear(ops.asarray(x), W), cpu.linear(x, w), 1e-5, ops, floor=1.0)
    check("linear fp32 3d+bias", ops.linear(ops.asarray(x.reshape(M, 1, K)), W, ops.asarray(b)),
          cpu.linear(x.reshape(M, 1, K), w, b), 1e-5, ops, floor=1.0)


@pytest.mark.parametrize("M", [1, 65, 300])
@pytest.mark.parametrize("path", ["wmma", "cublas", "wmma16", "cublas16"])
def test_mlp(ops, request, ops_fast, M, path):
    o = _path_ops(path, ops, request, ops_fast)
    o.token_block = 128                       # exercise the token blocking
    H, I = 96, 200
    x = r(M, H)
    wg, wu, wd = h16(r(I, H, scale=H ** -0.5)), h16(r(I, H, scale=H ** -0.5)), h16(r(H, I, scale=I ** -0.5))
    got = o.mlp(o.asarray(x), o.weight(wg), o.weight(wu), o.weight(wd))
    # fp16: the hidden product is also stored in fp16 before the down projection
    check(f"mlp {path} M{M}", got, cpu.mlp(x, wg, wu, wd), 6e-3 if path.endswith("16") else SPLIT_TOL, o)


@pytest.mark.parametrize("M", [1, 65, 300])
def test_mlp_mma(M):
    """The MLP's gemm_mma.cu path (gate and up on it, SwiGLU into fp16, the down GEMM on it too), taken by
    seeding the autotune's choices; hidden width 200 is not a multiple of 128, so both GEMMs cut tiles."""
    from clefcore.backends.cuda import CudaOps
    from clefcore.backends.cuda.matmul import shape_key
    o = CudaOps(0, gemm="auto", precision="fp16")
    if mma_tile(o.ctx.caps) is None:
        pytest.skip("gemm_mma.cu needs compute capability 8.0 or newer")
    H, I = 96, 200
    o.gemm.chosen[shape_key(M, 2 * I, H, "swiglu", o.plan.path)] = GemmRoute.MMA
    o.gemm.chosen[shape_key(M, H, I, "float16", o.plan.path)] = GemmRoute.MMA
    x = r(M, H)
    wg, wu, wd = h16(r(I, H, scale=H ** -0.5)), h16(r(I, H, scale=H ** -0.5)), h16(r(H, I, scale=I ** -0.5))
    with o.gemm_routes() as seen:
        got = o.mlp(o.asarray(x), o.weight(wg), o.weight(wu), o.weight(wd))
    assert set(seen.values()) == {GemmRoute.MMA}
    check(f"mlp mma M{M}", got, cpu.mlp(x, wg, wu, wd), 6e-3, o)


def test_weight_overflow_counted(ops):
    w = r(32, 32)
    w[0, 0] = 1e6
    before = ops.fp16_overflow
    W = ops.weight(w)
    assert ops.fp16_overflow == before + 1
    assert float(W[0, 0]) == 65504.0


def test_bf16_weight_converted_on_the_device(ops, tmp_path):
    """A bf16 checkpoint matrix travels as its bits and becomes the same fp16 values as through fp32 (every
    bf16 value in fp16 range is exact in fp16), with saturation and flush-to-zero counted."""
    from clefcore.checkpoint import SafetensorsFile, bf16_bits, write_safetensors
    w = r(65, 33)
    w[0, 0], w[1, 1], w[2, 2] = 1e6, -3e5, 1e-9                      # two saturate, one flushes to zero
    bits = bf16_bits(w)
    write_safetensors(tmp_path / "w.safetensors", {"w": ("BF16", w.shape, lambda: bits)})
    ref = SafetensorsFile(tmp_path / "w.safetensors").ref("w")
    over, under = ops.fp16_overflow, ops.fp16_underflow
    got = ops.to_host(ops.weight(ref))
    want = ops.to_host(ops.weight((bits.astype(np.uint32) << 16).view(np.float32)))
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, want)
    assert (ops.fp16_overflow - over, ops.fp16_underflow - under) == (4, 2)   # both conversions counted
    assert got[0, 0] == 65504 and got[1, 1] == -65504 and got[2, 2] == 0


def test_rotary_and_gate(ops):
    T, H, D, rd = 70, 4, 64, 16
    pos = np.arange(T) + 5
    c, s = cpu.rope_tables(pos, rd, 1e7)
    gc, gs = ops.rope_tables(pos, rd, 1e7)
    check("rope cos", gc, c, 1e-6, ops)
    x = r(T, H, 2, D)
    got = ops.rotary(ops.asarray(x)[:, :, 0], gc, gs)
    check("rotary", got, cpu.rotary(x[:, :, 0], c, s), 1e-6, ops)
    o, g = r(T, H, D), r(T, H, 2, D)
    check("sigmoid_gate", ops.sigmoid_gate(ops.asarray(o), ops.asarray(g)[:, :, 1]),
          cpu.sigmoid_gate(o, g[:, :, 1]), 1e-6, ops)


CU = [[0, 1], [0, 63], [0, 65], [0, 1, 64, 129, 259], [0, 300], [0, 65, 130, 131]]


@pytest.mark.parametrize("cu", CU)
@pytest.mark.parametrize("D,hq,hkv", [(16, 2, 1), (32, 4, 2), (64, 4, 4), (128, 4, 1), (256, 4, 2)])
def test_attention(ops, cu, D, hq, hkv):
    T = cu[-1]
    q, k, v = r(T, hq, D), r(T, hkv, D), r(T, hkv, D)
    scale = D ** -0.5
    cu = np.array(cu)
    got = ops.attention(ops.asarray(q), ops.asarray(k), ops.asarray(v), cu, scale)
    check(f"attention D{D} cu{list(cu)}", got, cpu.attention(q, k, v, cu, scale), 4e-3, ops)


def test_attention_long(ops):
    cu = np.array([0, 2100, 2400])
    q, k, v = r(2400, 4, 256), r(2400, 2, 256), r(2400, 2, 256)
    got = ops.attention(ops.asarray(q), ops.asarray(k), ops.asarray(v), cu, 1 / 16)
    check("attention long", got, cpu.attention(q, k, v, cu, 1 / 16), 4e-3, ops)


def test_attention_more_tiles_than_grid_y(ops):
    """65,537 one-token sequences: more query tiles than a grid's y dimension takes (65,535), so the kernel runs
    in two launches. A lone key gets all the weight: each output row is its value row (fp16-rounded)."""
    T, hq, hkv = 65537, 2, 1
    q, k, v = r(T, hq, 16), r(T, hkv, 16), r(T, hkv, 16)
    got = ops.attention(ops.asarray(q), ops.asarray(k), ops.asarray(v), np.arange(T + 1), 0.25)
    want = np.repeat(h16(v), hq, axis=1)
    check("attention 65,537 sequences", got, want, 1e-6, ops)


@pytest.mark.parametrize("cu", CU)
@pytest.mark.parametrize("K", [1, 4, 8])
def test_conv1d(ops, cu, K):
    T, C = cu[-1], 72
    x, w = r(T, 3 * C), r(C, K)
    xs = x[:, C:2 * C]
    got = ops.conv1d_silu(ops.asarray(x)[:, C:2 * C], ops.asarray(w), np.array(cu))
    check(f"conv1d K{K} cu{cu}", got, cpu.conv1d_silu(np.ascontiguousarray(xs), w, np.array(cu)), 1e-5, ops)


def _gdn_inputs(T, hk, hv, dk, dv):
    q = cpu.l2norm(r(T, hk, dk), 1e-6, dk ** -0.5)
    k = cpu.l2norm(r(T, hk, dk), 1e-6)
    v = r(T, hv, dv)
    g, beta = cpu.gdn_gates(r(T, hv), r(T, hv), r(hv, scale=0.5), r(hv))
    return q, k, v, g, beta


def _gdn_floor(q, k, v, beta):
    """The size one token's output would have with q parallel to k: beta |q| |k| max |v|. At a single token the
    output is beta (q . k) v, and q . k of random directions may cancel to ~1e-5 of |q| |k| (its rounding error
    stays ~1e-7 of |q| |k|), so the error is measured against this, not against the cancelled result."""
    return float(np.max(beta) * np.max(np.linalg.norm(q, axis=-1)) * np.max(np.linalg.norm(k, axis=-1)) *
                 np.max(np.abs(v)))


@pytest.mark.parametrize("cu", CU)
@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 4, 16, 16), (1, 2, 128, 128), (2, 2, 32, 64)])
def test_gated_delta_rule(ops, cu, hk, hv, dk, dv):
    q, k, v, g, beta = _gdn_inputs(cu[-1], hk, hv, dk, dv)
    floor = _gdn_floor(q, k, v, beta)
    ga, gb = ops.gdn_gates(*(ops.asarray(a) for a in (r(3, hv), r(3, hv), r(hv), r(hv))))
    assert ga.shape == (3, hv)
    ref = cpu.gated_delta_rule(q, k, v, g, beta, np.array(cu))
    for blk in (128, 1):                      # 1: every chunk its own block (state carried between launches)
        ops.delta_rule.block_chunks = blk
        got = ops.gated_delta_rule(*(ops.asarray(a) for a in (q, k, v, g, beta)), np.array(cu))
        check(f"gdn cu{cu} dk{dk} dv{dv} blk{blk}", got, ref, 2e-4, ops, floor)
    ops.delta_rule.block_chunks = 128


def _state0(B, hv, dk, dv):
    return r(B, hv, dk, dv, scale=0.5)


@pytest.mark.parametrize("cu", CU + [[0, 130], [0, 17, 17, 147]])
@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 4, 16, 16), (1, 2, 128, 128), (2, 2, 32, 64)])
def test_gated_delta_rule_state(ops, cu, hk, hv, dk, dv):
    """Sequences start from given states; the final states are written back in place (an empty one keeps its)."""
    q, k, v, g, beta = _gdn_inputs(cu[-1], hk, hv, dk, dv)
    S0 = _state0(len(cu) - 1, hv, dk, dv)
    S_ref = S0.copy()
    ref = cpu.gated_delta_rule(q, k, v, g, beta, np.array(cu), S_ref)
    for blk, bv in ((128, 16), (1, 16), (128, 32), (1, 32)):   # both scan widths (dv % 32 == 0 for 32)
        if dv % bv:
            continue
        ops.delta_rule.block_chunks = blk
        ops.delta_rule.scan_columns = lambda *a, bv=bv: bv
        try:
            S = ops.asarray(S0)
            got = ops.gated_delta_rule(*(ops.asarray(a) for a in (q, k, v, g, beta)), np.array(cu), S)
        finally:
            ops.delta_rule.block_chunks = 128
            del ops.delta_rule.scan_columns
        check(f"gdn state cu{cu} dk{dk} dv{dv} blk{blk} bv{bv} out", got, ref, 2e-4, ops)
        check(f"gdn state cu{cu} dk{dk} dv{dv} blk{blk} bv{bv} state", S, S_ref, 2e-4, ops)
    # a strided view is updated in place too
    big = ops.asarray(np.concatenate([S0, S0], axis=-1))
    view = big[..., :dv]
    ops.gated_delta_rule(*(ops.asarray(a) for a in (q, k, v, g, beta)), np.array(cu), view)
    check(f"gdn state view cu{cu}", view, S_ref, 2e-4, ops)
    check("gdn state view untouched half", big[..., dv:], S0, 0.0, ops)


@pytest.mark.parametrize("split", [1, 37, 63, 64, 65, 129])
def test_gated_delta_rule_split_carry(ops, split):
    """Two calls with the state carried == one call (numpy reference), packed with a sequence cut in two."""
    hk, hv, dk, dv = 1, 2, 128, 128
    T = 200
    q, k, v, g, beta = _gdn_inputs(T + 70, hk, hv, dk, dv)
    S0 = _state0(2, hv, dk, dv)
    S_ref = S0.copy()
    ref = cpu.gated_delta_rule(q, k, v, g, beta, np.array([0, T, T + 70]), S_ref)
    S = ops.asarray(S0)
    dev = [ops.asarray(a) for a in (q, k, v, g, beta)]
    first = ops.gated_delta_rule(*(a[:split] for a in dev), np.array([0, split]), S[:1])
    # second call: the rest of sequence 0 packed with the whole of sequence 1
    S1 = S[:2].copy()
    second = ops.gated_delta_rule(*(a[split:] for a in dev), np.array([0, T - split, T + 70 - split]), S1)
    got = np.concatenate([ops.to_host(first), ops.to_host(second)])
    check(f"gdn split {split} out", got, ref, 2e-4)
    check(f"gdn split {split} state", S1, S_ref, 2e-4, ops)


def test_gdn_gates(ops):
    a, b, al, dt = r(65, 8, scale=10), r(65, 8), r(8), r(8)
    g, beta = ops.gdn_gates(*(ops.asarray(x) for x in (a, b, al, dt)))
    g0, b0 = cpu.gdn_gates(a, b, al, dt)
    check("gdn_gates g", g, g0, 1e-5, ops)
    check("gdn_gates beta", beta, b0, 1e-6, ops)


def _ref(raw, dtype="BF16"):
    return types.SimpleNamespace(raw=raw, dtype=dtype, shape=raw.shape)


def test_tables(ops):
    from clefcore.backends.cuda import CudaOps
    from clefcore.checkpoint import bf16_bits, to_float32
    vals = r(300, 72)
    ref = _ref(bf16_bits(vals))
    full = to_float32(ref)
    ids = RNG.integers(0, 300, 65)
    for mode in ("host", "device"):
        o = CudaOps(0, tables=mode, ptx70=ops.ctx.ptx70)
        t = o.table(ref)
        check(f"embed {mode}", o.embed(t, ids), cpu.embed(full, ids), 0.0, o)
        check(f"gather_rows {mode}", o.gather_rows(t, ids[:7]), cpu.gather_rows(full, ids[:7]), 0.0, o)


def test_head_ops(ops):
    x = r(65, 32)
    check("gelu", ops.gelu(ops.asarray(x * 3)), cpu.gelu(x * 3), 1e-6, ops)
    check("sigmoid", ops.sigmoid(ops.asarray(x)), cpu.sigmoid(x), 1e-6, ops)
    check("silu", ops.silu(ops.asarray(x)), cpu.silu(x), 1e-6, ops)
    check("normalize", ops.normalize(ops.asarray(x), 1e-8), cpu.normalize(x, 1e-8), 1e-6, ops)
    st, en = np.array([0, 5, 60]), np.array([1, 30, 65])
    check("span_means", ops.span_means(ops.asarray(x), st, en), cpu.span_means(x, st, en), 1e-6, ops)
    W, heads = 32, 4
    xq, xkv = r(7, W), r(65, W)
    in_w, in_b, out_w, out_b = h16(r(3 * W, W, scale=0.2)), r(3 * W), h16(r(W, W, scale=0.2)), r(W)
    got = ops.mha(ops.asarray(xq), ops.asarray(xkv), ops.weight(in_w), ops.asarray(in_b), ops.weight(out_w),
                  ops.asarray(out_b), heads)
    check("mha", got, cpu.mha(xq, xkv, in_w, in_b, out_w, out_b, heads), 4e-3, ops)
    sc, vals, own = r(9), r(9, W), np.array([0, 0, 1, 1, 1, 2, 2, 2, 2])
    check("segment_softmax_sum", ops.segment_softmax_sum(ops.asarray(sc), ops.asarray(vals), own, 3),
          cpu.segment_softmax_sum(sc, vals, own, 3), 1e-6, ops)


@pytest.mark.parametrize("nq,nk", [([1], [1]), ([7, 1, 3], [65, 63, 1]), ([2, 300], [130, 17])])
def test_mha_groups(ops, nq, nk):
    """Packed joint-head attention: each query group attends to its own keys only (awkward group sizes)."""
    W, heads = 32, 4
    gq = np.repeat(np.arange(len(nq)), nq)
    gk = np.repeat(np.arange(len(nk)), nk)
    xq, xkv = r(len(gq), W), r(len(gk), W)
    in_w, in_b, out_w, out_b = h16(r(3 * W, W, scale=0.2)), r(3 * W), h16(r(W, W, scale=0.2)), r(W)
    want = cpu.mha(xq, xkv, in_w, in_b, out_w, out_b, heads, (gq, gk))
    got = ops.mha(ops.asarray(xq), ops.asarray(xkv), ops.weight(in_w), ops.asarray(in_b), ops.weight(out_w),
                  ops.asarray(out_b), heads, (gq, gk))
    check(f"mha groups {nq}/{nk}", got, want, 4e-3, ops)
    xd = ops.asarray(xq)                  # self-attention: one array as queries and keys (one [q | k | v] GEMM)
    want = cpu.mha(xq, xq, in_w, in_b, out_w, out_b, heads, (gq, gq))
    got = ops.mha(xd, xd, ops.weight(in_w), ops.asarray(in_b), ops.weight(out_w), ops.asarray(out_b), heads, (gq, gq))
    check(f"mha self groups {nq}", got, want, 4e-3, ops)


def test_check_finite(ops):
    from clefcore.errors import DeviceError
    ops.check_finite(ops.asarray(r(10, 10)), "ok")
    bad = r(10, 10)
    bad[3, 3] = np.nan
    with pytest.raises(DeviceError):
        ops.check_finite(ops.asarray(bad), "nan")
    with pytest.raises(DeviceError):
        ops.check_finite(ops.asarray(np.zeros((4, 4), np.float32)), "zeros")
    # exact counts on a large awkward size (the counts are reduced per warp and over a capped grid)
    big = r(1_000_003)
    idx = np.random.default_rng(5).choice(big.size, 37, replace=False)
    big[idx[:30]] = np.nan
    big[idx[30:]] = -np.inf
    with pytest.raises(DeviceError, match="37 of 1000003 values"):
        ops.check_finite(ops.asarray(big), "big")
    one = np.zeros(1_000_003, np.float32)
    one[-1] = 1e-30
    ops.check_finite(ops.asarray(one), "one nonzero")     # a single nonzero value is not "all zero"
    ops.watch(ops.asarray(big), "watched big")
    ops.watch(ops.asarray(r(65)), "watched ok")
    with pytest.raises(DeviceError, match="watched big: 37 of"):
        ops.check_watched()
    ops.check_watched()                                     # the flags were consumed


@pytest.mark.parametrize("n", [1, 63, 65])
def test_kv_write_from_a_projection_slice(ops, n):
    """v as the model passes it (the last columns of the fused q|k|v projection, viewed [n, heads, D]): written
    into rows t0.. of the fp16 cache, rounded to nearest like numpy's float16 cast, other rows untouched."""
    hkv, D, t0 = 2, 40, 3
    qkv = r(n, 5 + hkv * D, scale=100.0)
    cache = ops.kv_cache(n + 7, hkv, D)
    cache.fill(7.0)
    ops.kv_write(cache, t0, ops.asarray(qkv)[:, 5:].reshape(n, hkv, D))
    got = ops.to_host(cache)
    assert np.array_equal(got[t0:t0 + n], qkv[:, 5:].reshape(n, hkv, D).astype(np.float16))
    assert (got[:t0] == 7).all() and (got[t0 + n:] == 7).all()


# ------------------------------------------------------------- token-blocked prefill (model/backbone.py)

@pytest.mark.parametrize("cu", [[0, 300], [0, 1, 64, 129, 259], [0, 65, 130, 131]])
@pytest.mark.parametrize("block", [1, 63, 64, 65, 100])
@pytest.mark.parametrize("D,hq,hkv", [(64, 4, 2), (256, 4, 1)])
def test_attention_query_offset_fp16_cache(ops, cu, block, D, hq, hkv):
    """Queries [t0, t1) against an fp16 K/V cache whose rows past t1 hold garbage (NaN): never read."""
    T = cu[-1]
    q, k, v = r(T, hq, D), r(T, hkv, D), r(T, hkv, D)
    scale = D ** -0.5
    cu = np.array(cu)
    ref = cpu.attention(q, k, v, cu, scale)
    kc, vc = ops.kv_cache(T, hkv, D), ops.kv_cache(T, hkv, D)
    kc.fill(np.nan)
    vc.fill(np.nan)
    got = []
    for t0 in range(0, T, block):
        t1 = min(t0 + block, T)
        ops.kv_write(kc, t0, ops.asarray(k[t0:t1]))
        ops.kv_write(vc, t0, ops.asarray(v[t0:t1]))
        got.append(ops.to_host(ops.attention(ops.asarray(q[t0:t1]), kc, vc, cu, scale, q_offset=t0)))
    check(f"attention offset D{D} cu{list(cu)} block{block}", np.concatenate(got), ref, 4e-3)


@pytest.mark.parametrize("block", [1, 2, 3, 5, 64])
def test_conv1d_prev_rows(ops, block):
    from clefcore.model.backbone import _conv_tail
    T, C = 130, 72
    x, w = r(T, 3 * C), r(C, 4)
    ref = cpu.conv1d_silu(np.ascontiguousarray(x[:, C:2 * C]), w, np.array([0, T]))
    xd, wd = ops.asarray(x)[:, C:2 * C], ops.asarray(w)
    prev, got = None, []
    for t0 in range(0, T, block):
        xb = xd[t0:t0 + block]
        got.append(ops.to_host(ops.conv1d_silu(xb, wd, np.array([0, xb.shape[0]]), prev=prev)))
        prev = _conv_tail(ops.xp, prev, xb, 0, 3)
    check(f"conv1d prev block{block}", np.concatenate(got), ref, 1e-5)


@pytest.mark.parametrize("M,I", [(63, 201), (300, 200)])
def test_mlp_cublas_split(ops_cublas, M, I):
    """The cuBLAS split path (silu(g) * u written over g, then split for the down GEMM) at an odd hidden width
    (to_half_split's one-wide loop) and a multiple of 4 (its four-wide loop)."""
    o = ops_cublas
    H = 96
    x = r(M, H)
    wg, wu, wd = h16(r(I, H, scale=H ** -0.5)), h16(r(I, H, scale=H ** -0.5)), h16(r(H, I, scale=I ** -0.5))
    got = o.mlp(o.asarray(x), o.weight(wg), o.weight(wu), o.weight(wd))
    check(f"mlp cublas split M{M} I{I}", got, cpu.mlp(x, wg, wu, wd), SPLIT_TOL, o)


@pytest.mark.parametrize("M", [1, 65])
@pytest.mark.parametrize("K", [63, 256])
@pytest.mark.parametrize("path", ["wmma", "cublas"])
def test_split_range_scaling(ops, request, path, M, K):
    """The range-safe fallback (CudaOps.fallback, cuda/range.cuh): a split operand beyond fp16's range (one column
    near 1e6 here) enters scaled by a power of two and the product comes out at split's grade, where plain split
    gives Inf/NaN; an operand in range gives plain split's bits exactly. Then the same through the MLP, whose
    hidden product silu(g) * u overflows fp16 (both GEMM paths: the fused SwiGLU epilogue and cuBLAS)."""
    o = _path_ops(path, ops, request, None)
    N = 65
    w = h16(r(N, K, scale=K ** -0.5))
    W = o.weight(w)
    x = r(M, K)
    big = x.copy()
    big[:, 3] = 7.5e5 * np.sign(big[:, 3] + 0.5)
    plain = o.linear(o.asarray(x), W)
    assert not np.all(np.isfinite(o.to_host(o.linear(o.asarray(big), W)))), "plain split should overflow here"
    with o.fallback():
        assert o.plan == Plan("split", range_safe=True)
        np.testing.assert_array_equal(o.to_host(o.linear(o.asarray(x), W)), o.to_host(plain))
        check(f"linear range-safe {path} M{M} K{K}", o.linear(o.asarray(big), W), cpu.linear(big, w), SPLIT_TOL, o)
    assert not o.plan.range_safe
    H, I = 96, 200
    xm = r(M, H, scale=400.0)
    wg, wu, wd = h16(r(I, H, scale=H ** -0.5)), h16(r(I, H, scale=H ** -0.5)), h16(r(H, I, scale=I ** -0.5))
    ws = [o.weight(a) for a in (wg, wu, wd)]
    ref = cpu.mlp(xm, wg, wu, wd)
    hidden = cpu.silu(xm @ wg.T) * (xm @ wu.T)
    assert np.max(np.abs(hidden)) > 65504, "the test's hidden product must exceed fp16"
    with o.fallback():
        check(f"mlp range-safe {path} M{M}", o.mlp(o.asarray(xm), *ws), ref, SPLIT_TOL, o)


def _bits(a):
    return np.asarray(a).view(np.uint16)


@pytest.mark.parametrize("big", [False, True])
@pytest.mark.parametrize("n", [1, 63, 65, 4096, 4099])
def test_to_half_split(ops, n, big):
    """gemm.cu's split operand, both builds, both loops (n % 4 == 0 or not): hi = fp16(x), lo = fp16(x - hi)
    bit for bit. big: one value beyond fp16's range and the range-safe fallback's amax (abs_amax, checked bit for
    bit too): x enters scaled by 2^-(floor(log2 max|x|) - 14) (cuda/range.cuh), exactly."""
    x = r(n, scale=3.0)
    amax = np.uint64(0)
    if big:
        x[n // 2] = -3.0e5
        amax = ops.cp.zeros(1, ops.cp.uint32)
        ops.ctx.kernel("gemm.cu", "abs_amax")((4,), (256,), (ops.asarray(x), np.int64(n), amax))
        assert int(ops.to_host(amax)[0]) == int(np.float32(3.0e5).view(np.uint32))
    xin = ops.asarray(x)
    if big:                                  # what the kernel must feed the GEMM: x times an exact power of two
        x = x * np.float32(2.0 ** -(int(np.floor(np.log2(3.0e5))) - 14))
    hl = ops.cp.empty((2, n), ops.cp.float16)
    ops.ctx.kernel("gemm.cu", "to_half_split")(ops.ctx.grid1(n), (256,), (xin, hl[0], hl[1], np.int64(n), amax))
    hi = x.astype(np.float16)
    np.testing.assert_array_equal(_bits(ops.to_host(hl[0])), _bits(hi))
    np.testing.assert_array_equal(_bits(ops.to_host(hl[1])), _bits((x - hi.astype(np.float32)).astype(np.float16)))


def _host_lo_amax(v):
    v = np.asarray(v, np.float32)
    return np.float32(np.max(np.abs(v - v.astype(np.float16).astype(np.float32))))


@pytest.mark.parametrize("n", [4, 64, 4100, 1 << 20])
def test_lo_amax(ops, n):
    """fp8.cu's scale input, both builds: lo_amax = max |x - fp16(x)| over n / 4 float4s, exactly."""
    x = r(n, scale=2.0)
    amax = ops.cp.zeros(1, ops.cp.uint32)
    ops.ctx.kernel("fp8.cu", "lo_amax")(ops.matmul.amax_grid(n // 4), (256,), (ops.asarray(x), np.int64(n // 4), amax))
    assert ops.to_host(amax).view(np.float32)[0] == _host_lo_amax(x)


@pytest.mark.parametrize("with_amax", [True, False])
@pytest.mark.parametrize("n", [1, 63, 65, 4099, 4100, 1 << 20])
def test_swiglu_inplace(ops, n, with_amax):
    """fp8.cu's in-place SwiGLU, both builds, float4 body and scalar tail: g <- silu(g) * u (numpy's to fp32
    rounding), u untouched; with amax also max |h - fp16(h)| of what it wrote, bit for bit; without, no write."""
    cp = ops.cp
    g, u = r(n, scale=4.0), r(n)
    gd, ud = ops.asarray(g), ops.asarray(u)
    amax = cp.zeros(1, cp.uint32) if with_amax else np.uint64(0)
    ops.ctx.kernel("fp8.cu", "swiglu_inplace")(ops.matmul.amax_grid(-(-n // 4)), (256,), (ud, gd, np.int64(n), amax))
    h = ops.to_host(gd)
    check(f"swiglu_inplace n{n}", h, cpu.silu(g) * u, 1e-6)
    np.testing.assert_array_equal(ops.to_host(ud), u)
    if with_amax:
        assert ops.to_host(amax).view(np.float32)[0] == _host_lo_amax(h) > 0


# ----------------------------------------------------------------------------------------------- split8 (fp8 lo)
def test_e4m3_rounding(ops):
    """cuda/fp8.cu's software e4m3 rounding = ml_dtypes' (nearest even; subnormals; every e4m3 value, every
    midpoint between neighbours and the floats right beside it), on both builds."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    f8 = ml_dtypes.float8_e4m3fn
    vals = np.arange(256, dtype=np.uint8).view(f8).astype(np.float32)
    vals = np.unique(vals[np.isfinite(vals)])
    mids = ((vals[1:].astype(np.float64) + vals[:-1]) / 2).astype(np.float32)
    x = np.concatenate([vals, mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf)),
                        *(r(4097, scale=s) for s in (1e-3, 0.05, 1.0, 40.0))]).astype(np.float32)
    x = x[np.abs(x) <= 448]
    y = ops.cp.empty(x.size, dtype=ops.cp.uint8)
    ops.ctx.kernel("fp8.cu", "f32_to_e4m3")(ops.ctx.grid1(x.size), (256,), (ops.asarray(x), y, np.int64(x.size)))
    np.testing.assert_array_equal(ops.to_host(y), x.astype(f8).view(np.uint8))


@pytest.fixture(scope="module")
def ops_split8():
    from clefcore.backends.cuda import CudaOps
    if not HAVE_FP8 or not HAVE_CUBLAS:
        pytest.skip("split8 needs fp8 tensor cores (compute capability 8.9+) and cuBLASLt")
    return CudaOps(0, gemm="cublas", precision="split8")


# split8 keeps ~2^-11 * 2^-4 of each product (numpy emulation of these shapes: 0.7e-5..1.2e-5 of max |ref|);
# a dropped lo term would show the fp16 rounding, 2.0e-4..2.5e-4: the bound sits between the two
SPLIT8_TOL = 5e-5


@pytest.mark.parametrize("M", [1, 63, 65, 300])
@pytest.mark.parametrize("N,K", [(16, 64), (1008, 256), (200, 1008), (65, 40)])
def test_linear_split8(ops_split8, M, N, K):
    o = ops_split8
    x, w, b = r(M, K), h16(r(N, K, scale=K ** -0.5)), r(N)
    W = o.weight(w)
    twinned = W.data.ptr in o.twins.by_ptr
    assert twinned == (N % 4 == 0 and K % 16 == 0)                  # (65, 40) runs split
    tol = SPLIT8_TOL if twinned else SPLIT_TOL
    check(f"linear split8 {M}x{N}x{K}", o.linear(o.asarray(x), W), cpu.linear(x, w), tol, o)
    check(f"linear+bias split8 {M}x{N}x{K}", o.linear(o.asarray(x), W, o.asarray(b)), cpu.linear(x, w, b), tol, o)


@pytest.mark.parametrize("M", [1, 65, 300])
def test_mlp_split8(ops_split8, M):
    o = ops_split8
    o.token_block = 128
    H, I = 96, 208
    x = r(M, H)
    wg, wu, wd = h16(r(I, H, scale=H ** -0.5)), h16(r(I, H, scale=H ** -0.5)), h16(r(H, I, scale=I ** -0.5))
    got = o.mlp(o.asarray(x), o.weight(wg), o.weight(wu), o.weight(wd))
    check(f"mlp split8 M{M}", got, cpu.mlp(x, wg, wu, wd), SPLIT8_TOL, o)


def test_split8_weight_twin_scale(ops_split8):
    """The twin is the weight times a power of two with its largest magnitude in (224, 448], and the stored
    inverse undoes it."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    o = ops_split8
    w = h16(r(64, 32, scale=3.0))
    W = o.weight(w)
    _, w8, inv = o.twins.by_ptr[W.data.ptr]
    back = o.to_host(w8).view(ml_dtypes.float8_e4m3fn).astype(np.float32) * float(o.to_host(inv)[0])
    s = 1.0 / float(o.to_host(inv)[0])
    assert s == 2.0 ** round(np.log2(s)) and 224 < np.max(np.abs(w)) * s <= 448
    assert np.max(np.abs(back - w)) <= np.max(np.abs(w)) * 2.0 ** -4


def test_split8_weight_row_view(ops_split8):
    """A view of a twinned weight's first rows starts at the weight's address (the head's attention slices its
    in-projection so): it must not be taken for the weight; such views run split."""
    o = ops_split8
    x, w = r(65, 64), h16(r(192, 64, scale=0.125))
    W = o.weight(w)
    assert o.twins.of(W) is not None and o.twins.of(W[:64]) is None
    for a, b in ((0, 64), (64, 128), (128, 192)):
        check(f"linear split8 view rows {a}:{b}", o.linear(o.asarray(x), W[a:b]), cpu.linear(x, w[a:b]), SPLIT_TOL, o)
