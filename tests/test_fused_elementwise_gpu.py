"""The fast plan's fused producers on a GPU: every producer that writes the next weight GEMM's fp16 operand itself
(the RMSNorms' *_h kernels, the attention's fp16 output gate, the MLP's gate/up GEMM with SwiGLU in its epilogue
on gemm_mma.cu / gemm_wgmma.cu, gemm.cu's gemm_swiglu_f16a) gives the bits of the unfused composition: the fp32
value, then gemm.cu's to_half (or the GEMM's own rounding while staging), on awkward sizes (rows 1, 63, 65,
non-multiples of 16; the model's widths and odd ones) and on every GEMM route; then the whole golden model, fast,
run twice on each GEMM route: the same logits bit for bit, one prompt at a time and packed, the fused path taken.

Bit-equality is the test because it holds by construction (clefcore/precision.py ``Row.fused_elementwise``):
rounding an fp32 value to fp16 is one deterministic cvt.rn, so the producer rounding it equals the consumer
rounding it; the fused gate/up GEMM adds each output's products in the plain kernel's order. The op table
(tests/test_ops.py) holds the fused ops to numpy within the fast plan's per-op bound, which the bits then
inherit."""

import json
from pathlib import Path

import numpy as np
import pytest

from clefcore.backends import cpu
from clefcore.kernel_select import MMA_TILES, WGMMA_TILE, GemmRoute, mma_tile

from gpu_only import HAVE_CUBLAS, HAVE_MMA, MARKS, reseed

pytestmark = MARKS
cupy = pytest.importorskip("cupy")

RNG = np.random.default_rng()
GOLD = Path(__file__).parent / "golden"
# the fused MLP's hidden product against numpy on the same fp16 inputs: the output's rounding, plus fp32 sums in
# another order and silu_f's __expf (relative error ~2^-21 at these sizes), far below 1e-4
SWIGLU_OUT = 2.0 ** -11 + 1e-4


@pytest.fixture(autouse=True)
def _seeded(request):
    reseed(RNG, request)


def _ops(pin="wmma", ptx70=False):
    from clefcore.backends.cuda import CudaOps
    return CudaOps(0, gemm=pin, precision="fast", ptx70=ptx70)


@pytest.fixture(scope="module")
def fused():
    return _ops()


def r(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def h16(a):
    return a.astype(np.float16).astype(np.float32)


def bits(o, a):
    """a's bits on the host (fp16 as uint16, fp32 as uint32): equal bits, not close values."""
    a = o.to_host(a)
    return a.view(np.uint16 if a.dtype == np.float16 else np.uint32)


def assert_bits(o, got, want, what):
    g, w = bits(o, got), bits(o, want)
    assert g.dtype == w.dtype and g.shape == w.shape, (what, g.dtype, w.dtype, g.shape, w.shape)
    diff = int(np.count_nonzero(g != w))
    assert diff == 0, f"{what}: {diff} of {g.size} values differ in their bits"


def rel(o, got, ref):
    got = np.asarray(o.to_host(got), np.float64)
    return float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))


def always_fp16(monkeypatch, o):
    """Every gemm_input output in fp16, whatever its rows: the *_h kernels at 1 and 63 rows too, which the rule
    (Matmul.operand_dtype: more than 64 rows) leaves to the fp32 kernels in a forward."""
    monkeypatch.setattr(o.matmul, "operand_dtype", lambda rows: o.xp.float16)


# ------------------------------------------------------------------------------------------------------- norms

@pytest.mark.parametrize("R", [1, 63, 65, 130, 300])
@pytest.mark.parametrize("D", [1, 63, 65, 256, 4096])
def test_norms_write_the_rounding_of_their_fp32_result(fused, monkeypatch, R, D):
    """rmsnorm_rows_h, add_rmsnorm_rows_h (its sum still fp32) and gated_rmsnorm_rows_h on the warp (D < 1024)
    and the block path: fp16(the fp32 kernel's output) bit for bit."""
    o = fused
    always_fp16(monkeypatch, o)
    x, d, w, z = r(R, D), r(R, D), r(D, scale=0.1), r(R, D)
    X, Dd, W, Z = (o.asarray(a) for a in (x, d, w, z))
    got = o.rmsnorm(X, W, 1e-6, gemm_input=True)
    assert got.dtype == np.float16
    assert_bits(o, got, o.ctx.half(o.rmsnorm(X, W, 1e-6)), f"rmsnorm R{R} D{D}")
    s, y = o.add_rmsnorm(X, Dd, W, 1e-6, gemm_input=True)
    s0, y0 = o.add_rmsnorm(X, Dd, W, 1e-6)
    assert s.dtype == np.float32 and y.dtype == np.float16
    assert_bits(o, s, s0, f"add_rmsnorm sum R{R} D{D}")
    assert_bits(o, y, o.ctx.half(y0), f"add_rmsnorm R{R} D{D}")
    got = o.gated_rmsnorm(X, Z, W, 1e-6, gemm_input=True)
    assert_bits(o, got, o.ctx.half(o.gated_rmsnorm(X, Z, W, 1e-6)), f"gated_rmsnorm R{R} D{D}")


@pytest.mark.parametrize("T", [1, 63, 65, 300])
def test_gated_rmsnorm_as_the_model_calls_it(fused, monkeypatch, T):
    """The GDN's output norm: x [T, heads, d], z a per-head view of the wider fused projection (read in place
    through its row map), the result reshaped [T, heads * d] for the out-projection."""
    o = fused
    always_fp16(monkeypatch, o)
    H, D = 3, 64
    proj, x, w = r(T, 7 + H * D + 5), r(T, H, D), r(D, scale=0.1)
    zd = o.asarray(proj)[:, 7:7 + H * D].reshape(T, H, D)
    X, W = o.asarray(x), o.asarray(w)
    got = o.gated_rmsnorm(X, zd, W, 1e-6, gemm_input=True)
    assert got.shape == (T, H, D) and got.flags.c_contiguous
    assert_bits(o, got, o.ctx.half(o.gated_rmsnorm(X, zd, W, 1e-6)), f"gated_rmsnorm view T{T}")


@pytest.mark.parametrize("R,half", [(1, False), (64, False), (65, True), (300, True)])
def test_the_rows_rule_in_a_forward(fused, R, half):
    """Without forcing: a GEMM of up to 64 rows (it may take gemm_rows.cu, fp32 products) gets the fp32 kernel's
    output as it is; from 65 rows the fp16 one."""
    o = fused
    X, W = o.asarray(r(R, 96)), o.asarray(r(96, scale=0.1))
    got = o.rmsnorm(X, W, 1e-6, gemm_input=True)
    want = o.rmsnorm(X, W, 1e-6)
    assert got.dtype == (np.float16 if half else np.float32)
    assert_bits(o, got, o.ctx.half(want) if half else want, f"rmsnorm rule R{R}")


def test_exact_writes_fp32(fused):
    """The exact plans change nothing: fp32 from the fp32 kernels, whatever gemm_input; nor does the range-safe
    plan (split) a fast engine falls back to."""
    from clefcore.backends.cuda import CudaOps
    o = CudaOps(0, gemm="wmma", precision="exact")
    X, W = o.asarray(r(300, 96)), o.asarray(r(96, scale=0.1))
    assert_bits(o, o.rmsnorm(X, W, 1e-6, gemm_input=True), o.rmsnorm(X, W, 1e-6), f"exact {o.plan.path}")
    with fused.fallback():
        assert fused.rmsnorm(fused.asarray(r(300, 96)), W, 1e-6, gemm_input=True).dtype == np.float32


# ------------------------------------------------------------------------------------------- the output gate

@pytest.mark.parametrize("n", [1, 63, 65, 130])
@pytest.mark.parametrize("H,D", [(4, 32), (16, 256), (3, 65)])
def test_sigmoid_gate_writes_the_rounding_of_its_fp32_result(fused, monkeypatch, n, H, D):
    """The gate as the model passes it (the per-head gate half of the q projection, a strided view): CuPy's
    float16 conversion of the same quotient, gemm.cu's to_half bit for bit."""
    o = fused
    always_fp16(monkeypatch, o)
    ov, qg = r(n, H, D), r(n, H, 2, D)
    Ov, G = o.asarray(ov), o.asarray(qg)[:, :, 1]
    got = o.sigmoid_gate(Ov, G, gemm_input=True)
    assert got.dtype == np.float16 and got.shape == (n, H, D)
    assert_bits(o, got, o.ctx.half(o.sigmoid_gate(Ov, G)), f"sigmoid_gate n{n} {H}x{D}")


# ------------------------------------------------------------------------------------ GEMMs on fp16 operands

def _routes():
    return [GemmRoute.WMMA] + ([GemmRoute.CUBLAS] if HAVE_CUBLAS else []) + ([GemmRoute.MMA] if HAVE_MMA else [])


@pytest.mark.parametrize("route", _routes())
@pytest.mark.parametrize("M", [65, 130, 300])
@pytest.mark.parametrize("N,K", [(16, 64), (65, 40), (1000, 256), (130, 1000), (7, 4104)])
def test_every_route_takes_the_fp16_operand_as_its_own_rounding(fused, route, M, N, K):
    """An operand its producer rounded gives each route's result on the fp32 operand bit for bit (wmma:
    gemm_f16a against gemm_f32a's staging cvt; cuBLAS and mma: the cast pass skipped)."""
    o = fused
    if route is GemmRoute.MMA and K % 8:
        pytest.skip("gemm_mma.cu takes K % 8 == 0")
    cp = o.xp
    x, w = r(M, K), h16(r(N, K, scale=K ** -0.5))
    X, W = o.asarray(x), cp.asarray(w.astype(np.float16))
    want = o.gemm_with(route, X, W, cp.empty((M, N), cp.float32))
    got = o.gemm_with(route, o.ctx.half(X), W, cp.full((M, N), np.nan, cp.float32))
    assert_bits(o, got, want, f"{route} {M}x{N}x{K}")


# --------------------------------------------------------------------------------------------- the fused MLP

def _mma_kernels(o):
    """The "mma" route's kernels this GPU runs: gemm_wgmma.cu on Hopper, and every gemm_mma.cu tile it has the
    shared memory for (test_kernels.py's test_gemm_mma lowers max_smem_optin the same way): (tile, the shared
    memory to report for it, None: as it is)."""
    return (([(WGMMA_TILE[0], None)] if mma_tile(o.ctx.caps) == ("gemm_wgmma.cu", WGMMA_TILE) else [])
            + [(name, smem) for name, _, _, smem in MMA_TILES if smem <= o.ctx.max_smem_optin])


@pytest.mark.parametrize("M", [1, 63, 65, 130, 300])
@pytest.mark.parametrize("H,I", [(64, 160), (96, 200), (40, 201), (8, 1), (4096, 12288)])
def test_gate_up_swiglu_kernel_is_two_gemms_and_swiglu_half(fused, monkeypatch, M, H, I):
    """gemm_mma_swiglu{_big} / gemm_wgmma_swiglu against the unfused route (the tile's plain kernel on the gate,
    on the up weight, gemm.cu's swiglu_half): the same fp16 bits, every output written (H starts as NaN); I odd
    (the last group of 8 pairs padding rows), I = 1, I past one tile; rows past a tile; against numpy within
    the fast MLP's hidden rounding."""
    o = fused
    if mma_tile(o.ctx.caps) is None:
        pytest.skip("gemm_mma.cu needs compute capability 8.0 or newer")
    cp = o.xp
    x = r(M, H)
    wg, wu = h16(r(I, H, scale=H ** -0.5)), h16(r(I, H, scale=H ** -0.5))
    a16, Wg, Wu = o.ctx.half(o.asarray(x)), cp.asarray(wg.astype(np.float16)), cp.asarray(wu.astype(np.float16))
    for name, smem in _mma_kernels(o):
        if smem is not None:
            monkeypatch.setattr(o.ctx, "max_smem_optin", smem)     # the largest tile that fits is this one
        assert o.matmul.mma_tile()[1][0] == name
        g = o.matmul.mma(a16, Wg, cp.empty((M, I), cp.float32))
        u = o.matmul.mma(a16, Wu, cp.empty((M, I), cp.float32))
        want = cp.empty((M, I), cp.float16)
        o.ctx.kernel("gemm.cu", "swiglu_half")(o.ctx.grid1(g.size), (256,), (g, u, want, np.int64(g.size)))
        got = o.matmul.mma_swiglu(a16, Wg, Wu, cp.full((M, I), np.nan, cp.float16))
        assert_bits(o, got, want, f"{name} swiglu {M}x{I}x{H}")
        assert rel(o, got, cpu.silu(h16(x) @ wg.T) * (h16(x) @ wu.T)) <= SWIGLU_OUT, name


def _prefer(o, route):
    """The autotune (o's gemm is "auto") takes ``route`` wherever it is offered, else wmma, instead of timing
    them (which the test must not depend on), by seeding each choice before it is made: the choices are still
    recorded (gemm_routes)."""
    from clefcore.backends.cuda.matmul import shape_key
    choose = o.matmul.choose

    def seeded(M, N, K, routes, tag=""):
        o.gemm.chosen[shape_key(M, N, K, tag, o.plan.path)] = route if route in routes else GemmRoute.WMMA
        return choose(M, N, K, routes, tag)

    o.matmul.choose = seeded


@pytest.mark.parametrize("route", [r for r in _routes() if r is not GemmRoute.MMA])
@pytest.mark.parametrize("M", [1, 65, 300])
@pytest.mark.parametrize("H,I", [(64, 160), (96, 200)])
def test_mlp_is_bit_equal_whoever_rounds_its_input(route, M, H, I):
    """mlp on each route, x as its producer hands it (fp16 from 65 rows) against x in fp32 (the route rounds it
    itself: a cast pass, or the wmma GEMM while staging): the same output bits, over token blocks of 128 (a
    300-row call runs 128, 128, 44). The mma route casts an fp32 x and runs the very same fused kernel, so it has
    no second path here: test_gate_up_swiglu_kernel_is_two_gemms_and_swiglu_half holds that kernel to the
    unfused composition."""
    o = _ops(route.value)
    o.token_block = 128
    x = o.asarray(np.random.default_rng(M * 7 + I).standard_normal((M, H)).astype(np.float32))
    wts = [o.weight(h16(np.random.default_rng(s).standard_normal(shape).astype(np.float32) * 0.1))
           for s, shape in ((1, (I, H)), (2, (I, H)), (3, (H, I)))]
    operand = o.ctx.half(x) if o.matmul.operand_dtype(M) == o.xp.float16 else x
    assert_bits(o, o.mlp(operand, *wts), o.mlp(x, *wts), f"mlp {route} M{M} {H}x{I}")


# ------------------------------------------------------------------------------------- the whole golden model

def _records():
    recs = [json.loads(line) for line in (GOLD / "expected.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in recs if "input_ids" in r]


def _questions(rec):
    import types
    return [types.SimpleNamespace(question_span=tuple(q["question_span"]),
                                  option_spans=[tuple(s) for s in q["option_spans"]], type_index=q["type_index"])
            for q in rec["questions"]]


def _configs():
    from clefcore.backends.cuda import compile as C
    return (["wmma"] + (["cublas"] if HAVE_CUBLAS else []) + (["mma"] if HAVE_MMA else [])
            + (["ptx70-wmma"] if C.ptx70_available() else []))


def _golden_run(config):
    """Every golden record's logits one by one (short prompts replay a CUDA graph from the second time their
    length bucket is seen), then five records packed in one forward, and the GEMM routes' keys seen."""
    from clefcore.checkpoint import Checkpoint
    from clefcore.model.backbone import backbone
    from clefcore.model.head import heads
    from clefcore.model.params import load_params
    o = _ops({"mma": "auto"}.get(config, config.split("-")[-1]), ptx70=config.startswith("ptx70"))
    if config == "mma":
        _prefer(o, GemmRoute.MMA)
    p = load_params(Checkpoint(GOLD / "model"), o)
    recs = _records()
    logits = []
    with o.gemm_routes() as seen:
        for rec in recs:
            ids = np.array(rec["input_ids"], np.int64)
            L = len(ids)
            hs, _ = backbone(o, p, ids, np.array([0, L]), np.arange(L))
            logits += heads(o, p, hs, ids, np.array([0, L]), [_questions(rec)])[0]
        five = recs[:5]
        ids = np.concatenate([np.array(r["input_ids"], np.int64) for r in five])
        lens = [len(r["input_ids"]) for r in five]
        cu = np.concatenate([[0], np.cumsum(lens)])
        hs, _ = backbone(o, p, ids, cu, np.concatenate([np.arange(n) for n in lens]))
        packed = heads(o, p, hs, ids, cu, [_questions(r) for r in five])
    return [np.asarray(z) for z in logits], [np.asarray(z) for b in packed for z in b], dict(seen), p


@pytest.mark.parametrize("config", _configs())
def test_golden_logits_are_the_same_bits_run_to_run(config):
    """The golden checkpoint (tests/golden), fast, GEMMs pinned to one route (mma: every GEMM that can take it;
    ptx70: the Volta build's wmma), on two backends: every question's logits equal bit for bit, so the
    probabilities are too (nothing in the forward, the head's softmax sums included, adds in an order the GPU
    chooses); and the fused path did run (the layers' input projections took fp16 operands)."""
    first, first_packed, seen, p = _golden_run(config)
    again, again_packed, _, _ = _golden_run(config)
    for i, (a, b) in enumerate(zip(again + again_packed, first + first_packed)):
        assert a.dtype == b.dtype == np.float32 and np.array_equal(a.view(np.uint32), b.view(np.uint32)), \
            f"{config}: question {i} logits differ: {a} vs {b}"
    assert len(again) == len(first) and len(again_packed) == len(first_packed)
    layer = p.layers[0]
    width = next(w for n, w in layer.items() if n.endswith(("in_proj.weight", "qkv_proj.weight")))
    N, K = width.shape
    assert {k for k in seen if k[:2] == (N, K) and k[3] == "float16"}, (config, sorted(seen))


def test_the_engine_answers_the_same_twice():
    """clefcore.load on the golden checkpoint, fast, wmma, twice: the same response to every golden request one by
    one (refusals alike) and to the valid ones packed in one forward; this runs the engine's own path (prepare,
    forward, guards, answers)."""
    import clefcore
    from clefcore.errors import RequestError
    bodies = [json.loads(line) for line in (GOLD / "requests.jsonl").read_text().splitlines() if line.strip()]
    answers = []
    for _ in range(2):
        engine = clefcore.load(GOLD / "model", device="cuda", precision="fast", gemm="wmma")
        one = []
        for body in bodies:
            try:
                one.append(engine.decide(body))
            except RequestError as e:
                one.append(("refused", e.field, e.message))
        valid = [b for b, got in zip(bodies, one) if isinstance(got, dict)]
        assert len(valid) > 10
        answers.append((one, engine.decide_many(valid)))
    assert answers[0] == answers[1]
