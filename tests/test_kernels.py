"""What the op table (tests/test_ops.py) does not check of the CUDA backend: single GEMM kernels below the
``linear`` they serve (gemm_mma.cu / gemm_wgmma.cu per tile, gemm_rows.cu), the split operand and fp8 helpers bit
for bit, the range-safe fallback, weight conversion and its counts, the guards, launches past a grid's limits
and state carried between calls. Runs for the native NVRTC build and for the compute_70 PTX built by the pip
NVRTC 12 and JIT-compiled by the driver (the Volta code path itself); bounds as tests/test_ops.py states them.
"""

import types

import numpy as np
import pytest

from clefcore.backends import cpu
from clefcore.kernel_select import MMA_TILES, WGMMA_TILE, GemmRoute, mma_tile
from clefcore.precision import Plan

from gpu_only import HAVE_CUBLAS, HAVE_FP8, MARKS, reseed

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
def ops_fp16():
    from clefcore.backends.cuda import CudaOps
    return CudaOps(0, gemm="wmma", precision="fp16")


def _split_ops(pin, ops, request):
    """The split CudaOps pinned to wmma or cublas; cuBLAS skips where it cannot be loaded."""
    return ops if pin == "wmma" else request.getfixturevalue("ops_cublas")


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


# split-precision GEMMs (hi + lo fp16 halves of each fp32 activation, fp16-exact weights) are fp32-grade: on the
# H200 at 54dff08 the worst relative errors were 3.8e-6 (linear) and 1.6e-6 (MLP)
SPLIT_TOL = 2e-5


@pytest.mark.parametrize("tile", MMA_TILES, ids=[t[0] for t in MMA_TILES])
@pytest.mark.parametrize("M", [1, 63, 65, 300])
@pytest.mark.parametrize("N,K", [(16, 64), (65, 40), (1000, 256), (130, 1000), (129, 8), (7, 4104)])
def test_gemm_mma(ops_fp16, monkeypatch, M, N, K, tile):
    """gemm_mma.cu (sm_80+, native code only), each tile (a GPU with less shared memory per block takes the
    smaller one: the test lowers what this one reports): fp16 operands, so one rounding of x against numpy, as
    the other fp16 paths; rows and columns past a tile, K past a k-tile (the cp.async zero fill, K % 8 == 0), an
    odd N (the scalar stores), with bias and a residual; every output is written (it starts as NaN)."""
    o = ops_fp16
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
    cp = o.xp
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
def test_gemm_wgmma(ops_fp16, M, N, K):
    """gemm_wgmma.cu, the "mma" route on Hopper (sm_90a, native code only), as test_gemm_mma: rows and columns
    past its 128 x 256 tile, K past a 64-deep k-tile (zero-filled copies into the swizzled stages), an odd N,
    bias and a residual, every output written."""
    o = ops_fp16
    if mma_tile(o.ctx.caps) != ("gemm_wgmma.cu", WGMMA_TILE):
        pytest.skip("gemm_wgmma.cu runs on compute capability 9.0 (native code) only")
    check_mma_route(o, "gemm_wgmma", M, N, K)


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
    cp = ops.xp
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


def test_attention_more_tiles_than_grid_y(ops):
    """65,537 one-token sequences: more query tiles than a grid's y dimension takes (65,535), so the kernel runs
    in two launches. A lone key gets all the weight: each output row is its value row (fp16-rounded)."""
    T, hq, hkv = 65537, 2, 1
    q, k, v = r(T, hq, 16), r(T, hkv, 16), r(T, hkv, 16)
    got = ops.attention(ops.asarray(q), ops.asarray(k), ops.asarray(v), np.arange(T + 1), 0.25)
    want = np.repeat(h16(v), hq, axis=1)
    check("attention 65,537 sequences", got, want, 1e-6, ops)


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


@pytest.mark.parametrize("M", [1, 65])
@pytest.mark.parametrize("K", [63, 256])
@pytest.mark.parametrize("path", ["wmma", "cublas"])
def test_split_range_scaling(ops, request, path, M, K):
    """The range-safe fallback (CudaOps.fallback, cuda/range.cuh): a split operand beyond fp16's range (one column
    near 1e6 here) enters scaled by a power of two and the product comes out at split's grade, where plain split
    gives Inf/NaN; an operand in range gives plain split's bits exactly. Then the same through the MLP, whose
    hidden product silu(g) * u overflows fp16 (both GEMM paths: the fused SwiGLU epilogue and cuBLAS)."""
    o = _split_ops(path, ops, request)
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
        amax = ops.xp.zeros(1, ops.xp.uint32)
        ops.ctx.kernel("gemm.cu", "abs_amax")((4,), (256,), (ops.asarray(x), np.int64(n), amax))
        assert int(ops.to_host(amax)[0]) == int(np.float32(3.0e5).view(np.uint32))
    xin = ops.asarray(x)
    if big:                                  # what the kernel must feed the GEMM: x times an exact power of two
        x = x * np.float32(2.0 ** -(int(np.floor(np.log2(3.0e5))) - 14))
    hl = ops.xp.empty((2, n), ops.xp.float16)
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
    amax = ops.xp.zeros(1, ops.xp.uint32)
    ops.ctx.kernel("fp8.cu", "lo_amax")(ops.matmul.amax_grid(n // 4), (256,), (ops.asarray(x), np.int64(n // 4), amax))
    assert ops.to_host(amax).view(np.float32)[0] == _host_lo_amax(x)


@pytest.mark.parametrize("with_amax", [True, False])
@pytest.mark.parametrize("n", [1, 63, 65, 4099, 4100, 1 << 20])
def test_swiglu_inplace(ops, n, with_amax):
    """fp8.cu's in-place SwiGLU, both builds, float4 body and scalar tail: g <- silu(g) * u (numpy's to fp32
    rounding), u untouched; with amax also max |h - fp16(h)| of what it wrote, bit for bit; without, no write."""
    cp = ops.xp
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
    y = ops.xp.empty(x.size, dtype=ops.xp.uint8)
    ops.ctx.kernel("fp8.cu", "f32_to_e4m3")(ops.ctx.grid1(x.size), (256,), (ops.asarray(x), y, np.int64(x.size)))
    np.testing.assert_array_equal(ops.to_host(y), x.astype(f8).view(np.uint8))


@pytest.fixture(scope="module")
def ops_split8():
    from clefcore.backends.cuda import CudaOps
    if not HAVE_FP8 or not HAVE_CUBLAS:
        pytest.skip("split8 needs fp8 tensor cores (compute capability 8.9+) and cuBLASLt")
    return CudaOps(0, gemm="cublas", precision="split8")


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
