"""The fused elementwise producers without a GPU: where they apply, what each op routes to (recorded, not
launched), a numpy model of the fused gate/up GEMM's epilogue, and the fp16-writing norms' PTX. GPU side:
tests/test_fused_elementwise_gpu.py."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from clefcore.backends import cpu
from clefcore.backends.cpu import CpuOps
from clefcore.backends.cuda import attention
from clefcore.backends.cuda.attention import Attention
from clefcore.backends.cuda.device import DeviceContext
from clefcore.backends.cuda.matmul import MMA_SWIGLU, Matmul, swiglu_paired_rows
from clefcore.backends.cuda.norms import Norms
from clefcore.kernel_select import MMA_TILES, WGMMA_TILE, GemmRoute
from clefcore.precision import RANGE_SAFE, TABLE, Plan

GOLD = Path(__file__).parent / "golden"


# ---------------------------------------------------------------------------------------------------- the row

@pytest.mark.parametrize("path", list(TABLE))
def test_only_the_fast_row_fuses(path):
    row = TABLE[path]
    assert row.fused_elementwise is (row.gemm.fp16 and row.mode == "fast")
    assert RANGE_SAFE.row.fused_elementwise is False          # the fallback's plan: split


class _FakeDevice(DeviceContext):
    """A device context over numpy (an sm_80 GPU where the mma route runs, else a Turing one) that records every
    kernel instead of launching it; its row maps and fp32 views are the real ones."""

    def __init__(self, path, mma, calls):
        self.cp, self.plan, self.switches, self.token_block, self.calls = np, Plan(path), frozenset(), 0, calls
        self.cc, self.ptx70, self.max_smem_optin, self.cublas_missing = (8, 0) if mma else (7, 5), False, 166912, None

    def contiguous(self, x):
        return np.ascontiguousarray(x, dtype=np.float32)

    def half(self, x):
        if x.dtype == np.float16:
            return x
        self.calls.append("cast")
        return x.astype(np.float16)

    def kernel(self, module, name, smem=0):
        return lambda grid, block, args, **kw: self.calls.append(name)

    def grid1(self, n):
        return (1,)


class _FakeMatmul(Matmul):
    """Matmul's routing with the GEMMs recorded and the autotune answering ``pick``."""

    def __init__(self, ctx, pick):
        super().__init__(ctx, None, None)
        self.pick, self.calls, self.offered = pick, ctx.calls, []

    def choose(self, M, N, K, routes, tag=""):
        self.offered.append(set(routes))
        return self.pick

    def mma_swiglu(self, a16, wg, wu, h16):
        assert a16.dtype == np.float16 and h16.dtype == np.float16
        self.calls.append("mma_swiglu")
        return h16

    def cublas(self, a16, w, out, accumulate=False):
        assert a16.dtype == np.float16
        self.calls.append("cublas")
        return out

    def gemm(self, x, w, out, bias=None):
        self.calls.append(f"gemm {x.dtype}")
        return out

    def range_amax(self, x):
        return np.uint64(0)


class _Fake:
    """The CUDA backend's norms, output gate and MLP on a _FakeDevice: every kernel recorded in ``calls``, the
    routes the MLP offered in ``offered``."""

    def __init__(self, path="fp16", pick=GemmRoute.MMA, mma=True):
        self.calls = []
        ctx = _FakeDevice(path, mma, self.calls)
        self.matmul = _FakeMatmul(ctx, pick)
        self.offered = self.matmul.offered
        self.norms, self.attention = Norms(ctx, self.matmul), Attention(ctx, self.matmul)


@pytest.mark.parametrize("path,rows,want", [
    ("fp16", 65, np.float16), ("fp16", 8192, np.float16),
    ("fp16", 64, np.float32), ("fp16", 1, np.float32),        # may take gemm_rows.cu (fp32 products)
    ("split", 8192, np.float32), ("split8", 8192, np.float32),
])
def test_the_operand_dtype_rule(path, rows, want):
    assert _Fake(path).matmul.operand_dtype(rows) is want


@pytest.mark.parametrize("path,R,fused", [("fp16", 65, True), ("fp16", 64, False), ("split", 65, False)])
def test_the_norms_pick_their_kernels(path, R, fused):
    """gemm_input and the rule fused: the *_h kernels into fp16; otherwise the fp32 kernels as before; without
    gemm_input (q/k norms, the final norm) always the fp32 ones; add_rmsnorm's sum stays fp32."""
    ops = _Fake(path)
    x, w = np.ones((R, 96), np.float32), np.ones(96, np.float32)
    h = "_h" if fused else ""
    want = np.float16 if fused else np.float32
    assert ops.norms.rmsnorm(x, w, 1e-6, gemm_input=True).dtype == want
    assert ops.norms.rmsnorm(x, w, 1e-6).dtype == np.float32
    s, y = ops.norms.add_rmsnorm(x, x, w, 1e-6, gemm_input=True)
    assert s.dtype == np.float32 and y.dtype == want
    g = ops.norms.gated_rmsnorm(x.reshape(R, 3, 32), x.reshape(R, 3, 32), w[:32], 1e-6, gemm_input=True)
    assert g.dtype == want and g.shape == (R, 3, 32)
    assert ops.calls == ["rmsnorm_rows" + h, "rmsnorm_rows", "add_rmsnorm_rows" + h, "gated_rmsnorm_rows" + h]


@pytest.mark.parametrize("path,n,half", [("fp16", 65, True), ("fp16", 64, False), ("split", 65, False)])
def test_the_output_gate_picks_its_kernel(monkeypatch, path, n, half):
    made = []
    monkeypatch.setattr(attention, "sigmoid_gate_k", lambda half=False: made.append(half) or (lambda o, g: None))
    ops = _Fake(path)
    o = np.ones((n, 4, 32), np.float32)
    ops.attention.sigmoid_gate(o, o, gemm_input=True)
    ops.attention.sigmoid_gate(o, o)
    assert made == [half, False]


# ---------------------------------------------------------------------------------------------------- the MLP

@pytest.mark.parametrize("path,pick,dtype,want", [
    ("fp16", GemmRoute.MMA, np.float16, ["mma_swiglu", "gemm float16"]),
    ("fp16", GemmRoute.MMA, np.float32, ["cast", "mma_swiglu", "gemm float16"]),   # a short block: fp32 input
    ("fp16", GemmRoute.WMMA, np.float32, ["gemm_swiglu_f32a", "gemm float16"]),
    ("fp16", GemmRoute.WMMA, np.float16, ["gemm_swiglu_f16a", "gemm float16"]),
    ("fp16", GemmRoute.CUBLAS, np.float32, ["cast", "cublas", "cublas", "swiglu_half", "cublas"]),
    ("fp16", GemmRoute.CUBLAS, np.float16, ["cublas", "cublas", "swiglu_half", "cublas"]),   # no cast pass
    # exact never fuses: no mma route offered, the split kernel on fp32 (an fp16 input widened back, exactly)
    ("split", GemmRoute.WMMA, np.float16, ["gemm_swiglu_f32a_split", "gemm float32"]),
])
def test_the_mlp_routes(path, pick, dtype, want):
    ops = _Fake(path, pick)
    x = np.ones((100, 64), dtype)
    w = np.ones((160, 64), np.float16)
    ops.matmul.mlp(x, w, w, np.ones((64, 160), np.float16))
    offered = {GemmRoute.WMMA, GemmRoute.CUBLAS} | ({GemmRoute.MMA} if path == "fp16" else set())
    assert ops.calls == want and ops.offered == [offered]


def test_every_mma_tile_has_its_fused_twin():
    """Each plain mma/wgmma tile's fused gate/up + SwiGLU kernel is built in the plain one's file: both are
    entry points of its PTX (gemm_wgmma.cu's for compute_90a, the only target it has bodies for)."""
    from clefcore.backends.cuda import compile as C
    assert set(MMA_SWIGLU) == {name for name, *_ in MMA_TILES} | {WGMMA_TILE[0]}
    try:
        ptx = {"gemm_mma.cu": C.ptx70_path("gemm_mma.cu").read_text(),
               "gemm_wgmma.cu": C.nvrtc().compile(C.source("gemm_wgmma.cu"), "gemm_wgmma.cu",
                                                  "compute_90a").image.decode(errors="replace")}
    except C.NvrtcError as e:
        pytest.skip(str(e))
    entries = {module: set(re.findall(r"\.entry (\w+)\(", text)) for module, text in ptx.items()}
    for plain, fused in MMA_SWIGLU.items():
        module = "gemm_wgmma.cu" if plain == WGMMA_TILE[0] else "gemm_mma.cu"
        assert {plain, fused} <= entries[module], (module, plain, fused)


# ----------------------------------------------------------------------------------------- the model's requests

class _Recording(CpuOps):
    """The numpy backend, recording which norms and gates were asked for a GEMM's operand."""

    def __init__(self):
        super().__init__()
        self.asked = []

    def _asked(name):                      # the model passes gemm_input by keyword
        def op(self, *args, gemm_input=False):
            self.asked.append((name, gemm_input))
            return getattr(cpu, name)(*args, gemm_input)
        return op

    rmsnorm, add_rmsnorm = _asked("rmsnorm"), _asked("add_rmsnorm")
    gated_rmsnorm, sigmoid_gate = _asked("gated_rmsnorm"), _asked("sigmoid_gate")


def test_the_backbone_asks_for_gemm_operands_where_a_gemm_is_the_only_reader(gold_params):
    """Each layer's input norm, post-mixer norm, GDN output norm and attention gate are asked for GEMM operands;
    the q/k norms (read by the rotary) and the final norm (read by the head) are not. On numpy the flag changes
    nothing: the same hidden states bit for bit."""
    from clefcore.checkpoint import Checkpoint
    from clefcore.model.backbone import backbone
    from clefcore.model.params import load_params
    ck = Checkpoint(GOLD / "model")
    rec = _Recording()
    p = load_params(ck, rec)
    ids = np.arange(70, dtype=np.int64) % ck.text.vocab_size
    hs, _ = backbone(rec, p, ids, np.array([0, 70]), np.arange(70))
    kinds = ck.text.layer_types
    n_attn, n_gdn = kinds.count("full_attention"), kinds.count("linear_attention")
    asked = {k: rec.asked.count(k) for k in set(rec.asked)}
    assert asked == {("rmsnorm", True): len(kinds), ("add_rmsnorm", True): len(kinds),
                     ("gated_rmsnorm", True): n_gdn, ("sigmoid_gate", True): n_attn,
                     ("rmsnorm", False): 2 * n_attn + 1}
    plain, _ = backbone(CpuOps(), gold_params, ids, np.array([0, 70]), np.arange(70))
    assert np.array_equal(hs, plain)


# --------------------------------------------------------------------- a numpy model of the fused gate/up GEMM

def swiglu_row(p, N):
    """gemm_swiglu.cuh's swiglu_row: (weight "g" or "u", row, ok) of paired row p."""
    row = ((p >> 4) << 3) | (p & 7)
    return ("u" if p & 8 else "g"), row, row < N


def _mma_sync_pairs(BM, BN, WARPS_M, WARPS_N):
    """gemm_mma.cu's SWIGLU epilogue (gemm_tile.cuh's gemm_store_row) for one block: per output pair it writes,
    (tile row, gate accumulator's tile column, up accumulator's tile column, output column - n0 / 2). The
    accumulators are named as the epilogue indexes them (acc(2 jj, t) = acc[i][2 jj][h * 2 + t] and acc(2 jj + 1,
    t) = acc[i][2 jj + 1][...], gemm_mma.cu's accessor); the m16n8 layout places acc[i][j][e] at row
    wm*WTM + i*16 + lane/4 + 8 (e >= 2), column wn*WTN + 8 j + 2 (lane % 4) + e % 2."""
    WTM, WTN = BM // WARPS_M, BN // WARPS_N
    MI, NJ = WTM // 16, WTN // 8
    out = []
    for warp in range(WARPS_M * WARPS_N):
        wm, wn = warp // WARPS_N, warp % WARPS_N
        for lane in range(32):
            for i in range(MI):
                for h in range(2):
                    erow = wm * WTM + i * 16 + (lane >> 2) + h * 8             # the epilogue's gr - m0
                    for jj in range(NJ // 2):
                        oc = (wn * WTN) // 2 + jj * 8 + (lane & 3) * 2         # its oc - n0 / 2
                        for t in range(2):
                            (jg, eg), (ju, eu) = (2 * jj, h * 2 + t), (2 * jj + 1, h * 2 + t)
                            row = wm * WTM + i * 16 + (lane >> 2) + 8 * (eg >= 2)
                            assert row == erow and row == wm * WTM + i * 16 + (lane >> 2) + 8 * (eu >= 2)
                            out.append((row, wn * WTN + 8 * jg + 2 * (lane & 3) + eg % 2,
                                        wn * WTN + 8 * ju + 2 * (lane & 3) + eu % 2, oc + t))
    return np.array(out)


def _wgmma_pairs(BM, BN):
    """gemm_wgmma.cu's SWIGLU epilogue, as _mma_sync_pairs: through its accessor acc(j, t) = acc[i][j * 4 + h * 2 +
    t] it reads acc[i][8 jj + h * 2 + t] (gate) and acc[i][8 jj + 4 + h * 2 + t] (up); wgmma's layout places
    acc[i][4 j + e] at row wg*WM + i*64 + warp*16 + lane/4 + 8 (e >= 2), column 8 j + 2 (lane % 4) + e % 2."""
    WM = BM // 2
    out = []
    for wg in range(2):
        for warp in range(4):
            for lane in range(32):
                for i in range(WM // 64):
                    for h in range(2):
                        erow = wg * WM + i * 64 + warp * 16 + (lane >> 2) + h * 8
                        for jj in range(BN // 16):
                            oc = jj * 8 + (lane & 3) * 2
                            for t in range(2):
                                cols = []
                                for idx in (8 * jj + h * 2 + t, 8 * jj + 4 + h * 2 + t):
                                    j, e = divmod(idx, 4)
                                    assert wg * WM + i * 64 + warp * 16 + (lane >> 2) + 8 * (e >= 2) == erow
                                    cols.append(8 * j + 2 * (lane & 3) + e % 2)
                                out.append((erow, cols[0], cols[1], oc + t))
    return np.array(out)


def _run_model(pairs, BM, BN, A, Wg, Wu):
    """The kernel's grid over A [M, K], Wg and Wu [N, K]: each block's tile product over its paired weight rows
    (zero rows where swiglu_row says not ok, zero A rows past M), then its epilogue's writes. Returns H (NaN where
    nothing was written) and how many times each output was written."""
    M, N = A.shape[0], Wg.shape[0]
    H, count = np.full((M, N), np.nan), np.zeros((M, N), int)
    for bn in range(-(-swiglu_paired_rows(N) // BN)):
        n0 = bn * BN
        Wt = np.zeros((BN, A.shape[1]))
        for r in range(BN):
            which, row, ok = swiglu_row(n0 + r, N)
            if ok:
                Wt[r] = (Wg if which == "g" else Wu)[row]
        for bm in range(-(-M // BM)):
            m0 = bm * BM
            At = np.zeros((BM, A.shape[1]))
            At[:min(BM, M - m0)] = A[m0:m0 + BM]
            P = At @ Wt.T
            gr, oc = m0 + pairs[:, 0], n0 // 2 + pairs[:, 3]
            keep = (gr < M) & (oc < N)
            g, u = P[pairs[keep, 0], pairs[keep, 1]], P[pairs[keep, 0], pairs[keep, 2]]
            H[gr[keep], oc[keep]] = g / (1 + np.exp(-g)) * u
            np.add.at(count, (gr[keep], oc[keep]), 1)
    return H, count


_LAYOUTS = {name: (_mma_sync_pairs, (bm, bn, wm, wn)) for (name, bm, bn, _), (wm, wn) in
            zip(MMA_TILES, [(4, 2), (2, 4)])}
_LAYOUTS[WGMMA_TILE[0]] = (_wgmma_pairs, WGMMA_TILE[1:3])


@pytest.mark.parametrize("tile", list(_LAYOUTS))
@pytest.mark.parametrize("M,N", [(1, 1), (63, 8), (65, 160), (300, 201), (129, 264)])
def test_the_pairing_and_epilogue_give_every_output_its_own_gate_and_up(tile, M, N):
    """The launch's grid (matmul.py: ceil(16 ceil(N / 8) / BN) column blocks), the loaders' paired rows and the
    epilogue's register pairs: every output (row, column) is written once, from the gate and up sums of that very
    row and column; rows and columns past M and N are not."""
    layout, shape = _LAYOUTS[tile]
    BM, BN = shape[:2]
    pairs = layout(*shape)
    assert len(pairs) == BM * BN // 2 and len({tuple(p) for p in pairs[:, [0, 3]]}) == len(pairs)
    rng = np.random.default_rng(M * 1000 + N)
    A, Wg, Wu = (rng.standard_normal(s) for s in ((M, 24), (N, 24), (N, 24)))
    H, count = _run_model(pairs, BM, BN, A, Wg, Wu)
    g, u = A @ Wg.T, A @ Wu.T
    assert np.array_equal(count, np.ones((M, N), int))
    np.testing.assert_allclose(H, g / (1 + np.exp(-g)) * u, rtol=1e-12, atol=1e-12)


def test_the_model_catches_a_wrong_pairing():
    """The model can fail: pairing each gate tile with the next gate tile instead of its up tile is caught."""
    BM, BN, WM, WN = 128, 128, 2, 4
    pairs = _mma_sync_pairs(BM, BN, WM, WN)
    pairs[:, 2] = (pairs[:, 1] + 16) % BN
    A, W = np.ones((5, 8)), np.arange(16 * 8, dtype=float).reshape(16, 8)
    H, _ = _run_model(pairs, BM, BN, A, W, W + 1)
    g, u = A @ W.T, A @ (W + 1).T
    assert not np.allclose(H, g / (1 + np.exp(-g)) * u)


# ------------------------------------------------------------------------------------------- the norms' PTX

def _float_ops(ptx: str, kernel: str) -> list[str]:
    body = re.search(rf"\.entry {kernel}\((.*?)\n\}}", ptx, re.S).group(1)
    ops = [line.split()[0] for line in body.splitlines() if line.strip() and not line.strip().startswith("//")]
    return [op for op in ops if ".f32" in op or ".f16" in op]


@pytest.mark.parametrize("target", ["compute_70", "compute_90"])
def test_the_fp16_norms_do_the_fp32_norms_arithmetic_then_round(target):
    """norms.cu's *_h kernels: the fp32 kernel's floating-point instructions in the same order (both group sizes'
    bodies), except that each store of y becomes a cvt.rn.f16.f32 (then a 16-bit store): the same fp32 value,
    rounded once to nearest even, as gemm.cu's to_half rounds it after the fp32 store (its f2h: the same cvt.rn)."""
    from clefcore.backends.cuda import compile as C
    try:
        ptx = C.compile_file("norms.cu", target).image.decode(errors="replace")
        half = C.compile_file("gemm.cu", target).image.decode(errors="replace")
    except C.NvrtcError as e:
        pytest.skip(str(e))
    assert _float_ops(half, "to_half") == ["ld.global.nc.f32", "cvt.rn.f16.f32"]
    for name in ("rmsnorm_rows", "add_rmsnorm_rows", "gated_rmsnorm_rows"):
        f32, f16 = _float_ops(ptx, name), _float_ops(ptx, name + "_h")
        # instruction for instruction, but where the fp32 kernel stores y (not add_rmsnorm's fp32 sum)
        assert len(f32) == len(f16), name
        diff = {(a, b) for a, b in zip(f32, f16) if a != b}
        assert diff == {("st.global.f32", "cvt.rn.f16.f32")}, (name, diff)
