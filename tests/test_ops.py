"""Every backend op against the fp32 numpy reference (clefcore/backends/cpu.py's functions), as one table.

``OPS``: one row per op (or way of calling it): fresh random inputs at awkward sizes (1, 63, 65, non-multiples of
16, packed batches), the call (written once, run on the backend and on the reference) and the bound, from the
precision row (clefcore/precision.py) or the delta rule's error model (tests/gdn_wy_model.py). ``BACKENDS``: numpy;
CUDA built natively and as compute_70 PTX (the Volta code path) by kernel path and ``--gemm`` choice. A new kernel
variant is an entry of ``BACKENDS``, a new op a row of ``OPS``. Calls go through the ``Backend`` protocol only
(clefcore/backends/interface.py). The numpy backend runs the reference's own functions: its rows hold it to the
reference bit for bit. The CUDA rows are marked ``gpu`` and skip without one.

Bounds (max |got - ref| / max |ref|, with a floor where the result can cancel far below its operands):
* fp32 kernels (norms, rotary, conv, gates, elementwise) differ from numpy by summation order and the last bits
  of exp/erf/tanh: 1e-6 .. 2e-5 as each row states, on every path.
* weight GEMMs by the row's ``gemm`` operands: fp16 (the activation rounded once to 11 significant bits, fp32
  accumulation): 4e-3, two such roundings (the MLP's hidden product stored in fp16): 6e-3; split (hi + lo fp16
  halves, fp16-exact weights): fp32-grade, 2e-5 (the H200 at 54dff08: 3.8e-6 linear, 1.6e-6 MLP), scaled with K
  past 4,096 (``clefcore.bench.kernels.tol_k``); split8 (lo in fp8 against the weight's fp8 twin, which a weight
  gets where N % 4 == 0 and K % 16 == 0, else it runs split): 5e-5, between its numpy emulation (0.7e-5 ..
  1.2e-5) and a lost lo term (2e-4).
* the causal attention reads the fp16 K/V cache on every path, and the joint head's attention takes fp16
  operands: 4e-3.
* the vision tower's block halves: the MLP's 6e-3 where the GEMMs round once to fp16, split's 2e-5 otherwise.
* the delta rule: its error model's distance from the reference on the same inputs, times 1.25, plus 1e-5
  (tests/gdn_wy_model.py: ``bound`` says why), and exact within its contract (``clefcore.bench.kernels.TOL_GDN``)
  too.
"""

from __future__ import annotations

import functools
import itertools
import types
import zlib
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Callable

import numpy as np
import pytest

from clefcore import precision
from clefcore.backends import cpu
from clefcore.bench import kernels as bench_kernels
from clefcore.precision import FP32, GemmOperands

from gpu_only import HAVE_CUBLAS, HAVE_FP8, HAVE_GPU, MARKS
import gdn_wy_model as wy

RNG = np.random.default_rng()


def r(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def h16(a):
    """fp16-exact values: what a GPU's fp16 weight holds (as bf16 checkpoint values are), given to numpy too."""
    return a.astype(np.float16).astype(np.float32)


# ---------------------------------------------------------------------------------------------- backends

@dataclass(frozen=True)
class BackendSpec:
    """One backend and variant: numpy, or CUDA by build (native / ptx70), kernel path, ``--gemm`` choice and
    kernel switch."""

    build: str              # "numpy", "native", "ptx70"
    path: str = FP32        # the kernel path (precision.TABLE's key)
    gemm: str = ""          # --gemm's value (CUDA)
    gdn_chunks: int = 128   # the delta rule's chunks per launch group (1: the state carried between launches)
    kernels: str = ""       # a kernel switch to turn on (clefcore/switches.py); SWITCH_VARIES: the rows it changes

    @property
    def id(self) -> str:
        if self.build == "numpy":
            return "numpy"
        chunks = "" if self.gdn_chunks == 128 else f"-chunks{self.gdn_chunks}"
        return f"{self.build}-{self.path}-{self.gemm}{chunks}" + (f"-{self.kernels}" if self.kernels else "")

    @property
    def first_gemm(self) -> bool:
        """The path's first --gemm choice: rows without weight GEMMs run on this variant only."""
        return self.gemm == ("cublas" if self.path == "split8" else "wmma")

    def marks(self):
        if self.build == "numpy":
            return []
        marks = list(MARKS)
        if self.gemm == "cublas" or self.path == "split8":
            marks.append(pytest.mark.skipif(not HAVE_CUBLAS, reason="cuBLAS cannot be loaded here"))
        if self.path == "split8":
            marks.append(pytest.mark.skipif(not HAVE_FP8, reason="split8 needs fp8 tensor cores (cc 8.9+)"))
        if self.build == "ptx70":
            marks.append(pytest.mark.skipif(not _have_ptx70(), reason="no NVRTC 12 for the compute_70 PTX"))
        return marks


def _have_ptx70() -> bool:
    if not HAVE_GPU:
        return False
    from clefcore.backends.cuda import compile as C
    return C.ptx70_available()


BACKENDS = [
    BackendSpec("numpy"),
    *(BackendSpec("native", path, gemm) for path in ("fp16", "split") for gemm in ("wmma", "cublas", "auto")),
    BackendSpec("native", "split8", "cublas"),
    *(BackendSpec("ptx70", path, gemm) for path in ("fp16", "split") for gemm in ("wmma", "auto")),
    *(BackendSpec(build, path, "wmma", gdn_chunks=1) for build in ("native", "ptx70") for path in ("fp16", "split")),
    *(BackendSpec(build, "fp16", "wmma", gdn_chunks=n, kernels="wy_one_pass") for build in ("native", "ptx70")
      for n in (128, 1)),
]
# the rows (Op.varies) each switch changes: on a switch's variant only those run
SWITCH_VARIES = {"wy_one_pass": "delta"}


@lru_cache(maxsize=None)
def backend(spec: BackendSpec):
    if spec.build == "numpy":
        return cpu.CpuOps()
    from clefcore.backends.cuda import CudaOps
    # token_block 128: the MLP's token blocking runs at the table's larger sizes
    return CudaOps(0, ptx70=spec.build == "ptx70", gemm=spec.gemm, precision=spec.path, token_block=128,
                   gdn_block_chunks=spec.gdn_chunks, kernels=spec.kernels or None)


def _reference():
    """The numpy reference called like a backend: cpu.py's functions on host arrays."""
    ops = {name: getattr(cpu, name) for name in (
        "rmsnorm", "add_rmsnorm", "gated_rmsnorm", "layernorm", "l2norm", "linear", "mlp", "rope_tables", "rotary",
        "sigmoid_gate", "kv_cache", "kv_write", "attention", "conv1d_silu", "gdn_gates", "gated_delta_rule", "gelu",
        "sigmoid", "normalize", "span_means", "segment_softmax_sum", "mha", "patch_rows", "vision_attention",
        "vision_mlp")}
    host = np.asarray
    return types.SimpleNamespace(xp=np, asarray=host, weight=host, to_host=host, **ops)


REF = _reference()


# -------------------------------------------------------------------------------------------------- bounds

def on_gpu(bound):
    """``bound`` on every GPU path; 0 on numpy's, which runs the reference's own functions."""
    return lambda row, inp, ref: 0.0 if row.gemm is GemmOperands.FP32 else bound


# an fp16 result against numpy's fp32, relative to the largest reference value: its one rounding (at most half an
# fp16 ulp, 2^-11 of the value) over the fp32 kernels' own bound (2e-5: the norms'), with room
FP16_OUT = 2.0 ** -11 + 3e-5


def gemm_input_bound(bound):
    """An op asked for a GEMM's input (``gemm_input``): fp16 where the row fuses and the GEMM has over 64 rows."""
    return lambda row, inp, ref: (FP16_OUT if row.fused_elementwise and inp["x"].shape[0] > 64
                                  else on_gpu(bound)(row, inp, ref))


SPLIT_TOL, SPLIT8_TOL = 2e-5, 5e-5
GEMM_BOUND = {GemmOperands.FP32: 0.0, GemmOperands.FP16: 4e-3, GemmOperands.SPLIT: SPLIT_TOL,
              GemmOperands.SPLIT8: SPLIT8_TOL}


def linear_bound(row, inp, ref):
    """One weight GEMM by the row's operands (the module docstring): split8 where the weight has a twin."""
    (N, K), operands = inp["w"].shape, row.gemm
    if operands.fp8_lo and not (N % 4 == 0 and K % 16 == 0):
        operands = GemmOperands.SPLIT
    return bench_kernels.tol_k(GEMM_BOUND[operands], K) if operands.split else GEMM_BOUND[operands]


def mlp_bound(row, inp, ref):
    """fp16: the hidden product is a second rounding; split8: gate/up and down each twinned or split, whichever
    their shape allows (split8's bound covers both)."""
    return 6e-3 if row.gemm.fp16 else GEMM_BOUND[row.gemm]


def block_bound(row, inp, ref):
    """The vision tower's block halves (fused passes around the GEMMs)."""
    return 0.0 if row.gemm is GemmOperands.FP32 else 6e-3 if row.gemm.fp16 else SPLIT_TOL


def delta_rule_bound(call):
    """From the error model: the row's ``call`` run on the model (the kernels' roundings replayed in numpy, as a
    backend) with the same inputs; exact's output within its contract too. A region outside the state view: bit
    for bit."""
    def bound(row, inp, ref):
        if row.delta_rule.module is None:
            return 0.0
        rule = functools.partial(wy.gated_delta_rule, operands=wy.KERNEL_OPERANDS[row.delta_rule.module])
        model = call(types.SimpleNamespace(asarray=np.asarray, to_host=np.asarray, gated_delta_rule=rule), inp)
        floor = wy.floor_of(*(inp[n] for n in ("q", "k", "v", "beta")))
        bounds = {"out": (min(bench_kernels.TOL_GDN if row.mode == "exact" else np.inf,
                              wy.bound(wy.rel(model["out"], ref["out"], floor))), floor), "untouched": 0.0}
        if "state" in ref:
            bounds["state"] = wy.bound(wy.rel(model["state"], ref["state"]))
        return {n: bounds[n] for n in ref}
    return bound


# ------------------------------------------------------------------------------------------------ the table

@dataclass(frozen=True)
class Op:
    """One row: ``make(size)`` draws host inputs; ``call(b, inp)`` runs the op on backend ``b`` and returns its
    outputs by name (run on the reference too); ``bound(row, inp, ref)``: a bound, (bound, floor) or a dict of
    them by output; ``paths``: the kernel paths it runs on (numpy's always); ``varies``: the backend variant
    besides the path it depends on ("gemm": it runs weight GEMMs, so each ``--gemm`` choice; "delta": the delta
    rule's launch groups); on the other variants it runs once, on each path's first choice."""

    name: str
    sizes: tuple
    make: Callable
    call: Callable
    bound: Callable
    paths: tuple = precision.KERNEL_PATHS
    varies: str = ""

    def runs_on(self, spec: BackendSpec) -> bool:
        if spec.build == "numpy":
            return True
        return (spec.path in self.paths and (self.varies == "gemm" or spec.first_gemm)
                and (self.varies == "delta" or spec.gdn_chunks == 128)
                and (not spec.kernels or self.varies == SWITCH_VARIES[spec.kernels]))


class DeviceOnly(tuple):
    """A size the numpy backend skips: it runs the reference's own functions, so a size that takes seconds of
    numpy there checks nothing more."""


def A(b, a):
    return b.asarray(a)


def _norm_inputs(size):
    R, D = size
    return {"x": r(R, D), "d": r(R, D), "w": r(D, scale=0.1), "z": r(R, D), "b": r(D)}


def _as_gemm_input(b, i):
    x, w = A(b, i["x"]), A(b, i["w"])
    s, y = b.add_rmsnorm(x, A(b, i["d"]), w, 1e-6, gemm_input=True)
    return {"rmsnorm": b.rmsnorm(x, w, 1e-6, gemm_input=True), "sum": s, "add_rmsnorm": y,
            "gated_rmsnorm": b.gated_rmsnorm(x, A(b, i["z"]), w, 1e-6, gemm_input=True),
            "sigmoid_gate": b.sigmoid_gate(x, A(b, i["g"])[:, 1], gemm_input=True)}


def _head_view(b, proj, T, H, D):
    """The q/k columns of a wider projection viewed [T, H, D]: no single row stride."""
    return A(b, proj)[:, 5:5 + H * D].reshape(T, H, D)


def _linear_inputs(size, fp16=True):
    M, N, K = size
    w = r(N, K, scale=K ** -0.5)
    return {"x": r(M, K), "w": h16(w) if fp16 else w, "b": r(N)}


def _mlp_inputs(size):
    M, H, I = size
    return {"x": r(M, H), "wg": h16(r(I, H, scale=H ** -0.5)), "wu": h16(r(I, H, scale=H ** -0.5)),
            "wd": h16(r(H, I, scale=I ** -0.5))}


def _rope_inputs(size):
    T, H, D, rd = size
    return {"pos": np.arange(T) + 5, "rd": rd, "x": r(T, H, 2, D), "o": r(T, H, D), "g": r(T, H, 2, D)}


def _rotary(b, inp):
    c, s = b.rope_tables(inp["pos"], inp["rd"], 1e7)
    return {"rotary": b.rotary(A(b, inp["x"])[:, :, 0], c, s)}


def _attention_inputs(size):
    cu, D, hq, hkv, *block = size
    T = cu[-1]
    return {"q": r(T, hq, D), "k": r(T, hkv, D), "v": r(T, hkv, D), "cu": np.array(cu), "scale": D ** -0.5,
            "block": block[0] if block else T}


def _attention_blocked(b, inp):
    """Token-blocked prefill: queries [t0, t1) against an fp16 K/V cache written block by block, whose rows
    past t1 hold NaN (never read)."""
    q, k, v, cu, scale, block = (inp[n] for n in ("q", "k", "v", "cu", "scale", "block"))
    T, hkv, D = k.shape
    kc, vc = b.kv_cache(T, hkv, D), b.kv_cache(T, hkv, D)
    kc.fill(np.nan)
    vc.fill(np.nan)
    got = []
    for t0 in range(0, T, block):
        t1 = min(t0 + block, T)
        b.kv_write(kc, t0, A(b, k[t0:t1]))
        b.kv_write(vc, t0, A(b, v[t0:t1]))
        got.append(b.to_host(b.attention(A(b, q[t0:t1]), kc, vc, cu, scale, q_offset=t0)))
    return {"out": np.concatenate(got)}


def _gdn_inputs(size):
    """size: (cu, (hk, hv, dk, dv), given states, decay: None for the kernel tests' gates, else a slow mean
    decay per token, which keeps the state long and carries every chunk's rounding forward)."""
    cu, (hk, hv, dk, dv), with_state, decay, *split = size
    (q, k, v, g, beta), S0 = wy.draw(RNG, cu, hk, hv, dk, dv, decay)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "cu": np.array(cu), "S0": S0 if with_state else None,
            "split": split[0] if split else None}


def _gdn(b, inp):
    S = None if inp["S0"] is None else A(b, inp["S0"].copy())
    out = b.gated_delta_rule(*(A(b, inp[n]) for n in ("q", "k", "v", "g", "beta")), inp["cu"], S)
    return {"out": out} if S is None else {"out": out, "state": S}


def _gdn_state_view(b, inp):
    """The states as a strided view of a wider array: updated in place, the rest untouched."""
    S0 = inp["S0"]
    big = A(b, np.concatenate([S0, S0], axis=-1))
    view = big[..., :S0.shape[-1]]
    out = b.gated_delta_rule(*(A(b, inp[n]) for n in ("q", "k", "v", "g", "beta")), inp["cu"], view)
    return {"out": out, "state": view, "untouched": big[..., S0.shape[-1]:]}


def _gdn_two_calls(b, inp):
    """Sequence 0 cut at ``split`` over two calls, the state carried; the second packs its rest with sequence 1."""
    split, (_, T, T2) = inp["split"], inp["cu"]
    S = A(b, inp["S0"].copy())
    dev = [A(b, inp[n]) for n in ("q", "k", "v", "g", "beta")]
    first = b.gated_delta_rule(*(a[:split] for a in dev), np.array([0, split]), S[:1])
    second = b.gated_delta_rule(*(a[split:] for a in dev), np.array([0, T - split, T2 - split]), S)
    return {"out": np.concatenate([b.to_host(first), b.to_host(second)]), "state": S}


def _mha_inputs(size):
    nq, nk, grouped = size
    W = 32
    gq, gk = np.repeat(np.arange(len(nq)), nq), np.repeat(np.arange(len(nk)), nk)
    return {"xq": r(len(gq), W), "xkv": r(len(gk), W), "in_w": h16(r(3 * W, W, scale=0.2)), "in_b": r(3 * W),
            "out_w": h16(r(W, W, scale=0.2)), "out_b": r(W), "gq": gq, "gk": gk, "grouped": grouped}


def _mha(b, inp):
    """Cross attention, then self attention (one array as queries and keys: one [q | k | v] GEMM); with groups
    or not (each query group attends to its own keys only: packed joint-head attention)."""
    w = (b.weight(inp["in_w"]), A(b, inp["in_b"]), b.weight(inp["out_w"]), A(b, inp["out_b"]), 4)
    grouped = inp["grouped"]
    xq = A(b, inp["xq"])
    cross = b.mha(xq, A(b, inp["xkv"]), *w, (inp["gq"], inp["gk"]) if grouped else None)
    return {"cross": cross, "self": b.mha(xq, xq, *w, (inp["gq"], inp["gq"]) if grouped else None)}


def _segments(size):
    counts = size
    own = np.repeat(np.arange(len(counts)), counts)
    return {"sc": r(own.size), "vals": r(own.size, 32), "own": own, "n": len(counts)}


def _vision_attention_inputs(size):
    cu, heads, D = size
    W, N = heads * D, cu[-1]
    ang = r(N, D // 2, scale=3.0)
    return {"x": r(N, W), "qkv_w": h16(r(3 * W, W, scale=W ** -0.5)), "qkv_b": r(3 * W, scale=0.1),
            "proj_w": h16(r(W, W, scale=W ** -0.5)), "proj_b": r(W, scale=0.1), "heads": heads,
            "cos": np.cos(ang), "sin": np.sin(ang), "cu": np.array(cu)}


def _vision_mlp_inputs(size):
    M, H, I = size
    return {"x": r(M, H), "w1": h16(r(I, H, scale=H ** -0.5)), "b1": r(I, scale=0.1),
            "w2": h16(r(H, I, scale=I ** -0.5)), "b2": r(H, scale=0.1)}


NORM_SIZES = tuple(itertools.product((1, 63, 65, 130), (1, 63, 65, 256, 4096)))
HEAD_VIEWS = ((1, 3, 32), (65, 3, 32), (33, 2, 1024))       # warp and block paths
GEMM_NK = ((16, 64), (65, 40), (1000, 256), (130, 1000), (1008, 256), (200, 1008))
# the MLP's widest K (12,288): split's accumulation error grows with K
LINEAR_SIZES = tuple((M, N, K) for M in (1, 63, 65, 300) for N, K in GEMM_NK) + ((65, 64, 12288),)
# one token, under / over a 64-row tile, packed streams with one-token and tile-straddling sequences
CU = ([0, 1], [0, 63], [0, 65], [0, 1, 64, 129, 259], [0, 300], [0, 65, 130, 131])
ATTN_DIMS = ((16, 2, 1), (32, 4, 2), (64, 4, 4), (128, 4, 1), (256, 4, 2))
GDN_CU = CU + ([0, 64], [0, 130], [0, 17, 17, 147])         # an empty sequence keeps its state
GDN_SHAPES = ((2, 4, 16, 16), (1, 2, 128, 128), (2, 2, 32, 64), (2, 2, 48, 48))
VISION_BLOCK_PATHS = ("fp16", "split")   # split8's twinned GEMMs in the tower: no bound measured yet

OPS = [
    Op("rmsnorm", NORM_SIZES, _norm_inputs,
       lambda b, i: {"y": b.rmsnorm(A(b, i["x"]), A(b, i["w"]), 1e-6)}, on_gpu(2e-5)),
    Op("add_rmsnorm", NORM_SIZES, _norm_inputs,
       lambda b, i: dict(zip(("sum", "norm"), b.add_rmsnorm(A(b, i["x"]), A(b, i["d"]), A(b, i["w"]), 1e-6))),
       lambda row, i, ref: {"sum": on_gpu(1e-6)(row, i, ref), "norm": on_gpu(2e-5)(row, i, ref)}),
    Op("gated_rmsnorm", NORM_SIZES, _norm_inputs,
       lambda b, i: {"y": b.gated_rmsnorm(A(b, i["x"]), A(b, i["z"]), A(b, i["w"]), 1e-6)}, on_gpu(2e-5)),
    Op("layernorm", NORM_SIZES, _norm_inputs,
       lambda b, i: {"y": b.layernorm(A(b, i["x"]), A(b, i["w"]), A(b, i["b"]))}, on_gpu(2e-5)),
    Op("l2norm", NORM_SIZES, _norm_inputs,
       lambda b, i: {"y": b.l2norm(A(b, i["x"]), 1e-6, 0.25)}, on_gpu(2e-5)),
    # the norms on views the model passes: a strided slice of [T, H, 2, D], and head views of a projection's
    # columns (read through a token stride and a head stride)
    Op("norms of strided views", ((1, 3, 32), (65, 3, 32)), lambda s: {"qg": r(*s[:2], 2, s[2]), "w": r(s[2])},
       lambda b, i: {"rmsnorm": b.rmsnorm(A(b, i["qg"])[:, :, 0], A(b, i["w"]), 1e-6),
                     "l2norm": b.l2norm(A(b, i["qg"])[:, :, 1], 1e-6)}, on_gpu(2e-5)),
    Op("norms of head views", HEAD_VIEWS,
       lambda s: {"T,H,D": s, "proj": r(s[0], 5 + s[1] * s[2] + 7), "w": r(s[2], scale=0.1), "b": r(s[2]),
                  "z": r(*s)},
       lambda b, i: {"l2norm": b.l2norm(_head_view(b, i["proj"], *i["T,H,D"]), 1e-6, 0.5),
                     "rmsnorm": b.rmsnorm(_head_view(b, i["proj"], *i["T,H,D"]), A(b, i["w"]), 1e-6),
                     "layernorm": b.layernorm(_head_view(b, i["proj"], *i["T,H,D"]), A(b, i["w"]), A(b, i["b"])),
                     "gated_rmsnorm": b.gated_rmsnorm(_head_view(b, i["proj"], *i["T,H,D"]), A(b, i["z"]),
                                                      A(b, i["w"]), 1e-6)},
       on_gpu(2e-5)),
    # gemm_input: where the row fuses (fp16 GEMM operands), a GEMM's input of more than 64 rows comes back as the
    # fp16 rounding of the fp32 result; otherwise the fp32 kernels' result
    Op("norms and the gate as a GEMM's input", NORM_SIZES + tuple((300, D) for D in (1, 63, 65, 256, 4096)),
       lambda s: {**_norm_inputs(s), "g": r(s[0], 2, s[1])}, _as_gemm_input,
       lambda row, i, ref: {"sum": on_gpu(1e-6)(row, i, ref),
                            "sigmoid_gate": gemm_input_bound(1e-6)(row, i, ref),
                            **dict.fromkeys(("rmsnorm", "add_rmsnorm", "gated_rmsnorm"),
                                            gemm_input_bound(2e-5)(row, i, ref))}),
    Op("gated_rmsnorm on a projection slice", ((1, 3, 32), (65, 3, 32)),
       lambda s: {"T,H,D": s, "proj": r(s[0], 7 + s[1] * s[2] + 5), "x": r(*s), "w": r(s[2], scale=0.1)},
       lambda b, i: {"y": b.gated_rmsnorm(A(b, i["x"]), _head_view(b, i["proj"][:, 2:], *i["T,H,D"]),
                                          A(b, i["w"]), 1e-6)}, on_gpu(2e-5)),
    Op("linear", LINEAR_SIZES, _linear_inputs,
       lambda b, i: {"y": b.linear(A(b, i["x"]), b.weight(i["w"])),
                     "y+bias": b.linear(A(b, i["x"]), b.weight(i["w"]), A(b, i["b"]))},
       linear_bound, varies="gemm"),
    # a matrix with a side under 16 stays fp32 and runs as a reduction; each output is a sum of K products of
    # unit variance overall, so 1 is its size (a single output can cancel near 0)
    Op("linear (fp32 weight)", tuple((M, *NK) for M in (1, 63, 65) for NK in ((1, 4096), (4, 63), (15, 65), (32, 8))),
       lambda s: _linear_inputs(s, fp16=False),
       lambda b, i: {"y": b.linear(A(b, i["x"]), b.weight(i["w"])),
                     "3d+bias": b.linear(A(b, i["x"][:, None, :]), b.weight(i["w"]), A(b, i["b"]))},
       lambda row, i, ref: (0.0 if row.gemm is GemmOperands.FP32 else 1e-5, 1.0)),
    # SwiGLU, H = 96; the hidden width odd (the split operand's one-wide loop), a multiple of 4 and of 16
    Op("mlp", ((1, 96, 200), (65, 96, 200), (300, 96, 200), (63, 96, 201), (300, 96, 201), (65, 96, 208)),
       _mlp_inputs,
       lambda b, i: {"y": b.mlp(A(b, i["x"]), b.weight(i["wg"]), b.weight(i["wu"]), b.weight(i["wd"]))}, mlp_bound,
       varies="gemm"),
    Op("rope_tables", ((1, 4, 64, 16), (70, 4, 64, 16), (65, 2, 64, 64)), _rope_inputs,
       lambda b, i: dict(zip(("cos", "sin"), b.rope_tables(i["pos"], i["rd"], 1e7))), on_gpu(1e-6)),
    Op("rotary", ((1, 4, 64, 16), (70, 4, 64, 16), (65, 2, 64, 64)), _rope_inputs, _rotary, on_gpu(1e-6)),
    Op("sigmoid_gate", ((1, 4, 64, 16), (70, 4, 64, 16), (63, 3, 65, 16)), _rope_inputs,
       lambda b, i: {"y": b.sigmoid_gate(A(b, i["o"]), A(b, i["g"])[:, :, 1])}, on_gpu(1e-6)),
    Op("attention", tuple((cu, *d) for cu in CU for d in ATTN_DIMS) + (DeviceOnly(([0, 2100, 2400], 256, 4, 2)),),
       _attention_inputs,
       lambda b, i: {"out": b.attention(*(A(b, i[n]) for n in "qkv"), i["cu"], i["scale"])}, on_gpu(4e-3)),
    # as the model calls it: K/V in the fp16 cache (on compute capability 9.0 at head dim 256, attention_wgmma.cu),
    # the queries in token blocks; clef-flash's 16 query heads on 4 K/V heads, and other ratios
    Op("attention on the fp16 K/V cache",
       tuple((cu, *d, blk) for cu in ([0, 300], [0, 1, 64, 129, 259], [0, 65, 130, 131])
             for d in ((64, 4, 2), (256, 4, 1)) for blk in (1, 63, 64, 65, 100))
       + tuple(([0, 65, 200], 256, hq, hkv, 200) for hq, hkv in ((2, 1), (8, 8), (32, 4), (16, 4)))
       + tuple(DeviceOnly((cu, 256, 16, 4, blk)) for cu in ([0, 1000], [0, 1, 64, 129, 259, 700])
               for blk in (1, 63, 64, 65, 128, 129, 300, 1000)),
       _attention_inputs, _attention_blocked, on_gpu(4e-3)),
    # x as the model passes it: the middle third of the conv's input columns
    Op("conv1d_silu", tuple(itertools.product(CU, (1, 4, 8))),
       lambda s: {"x": r(s[0][-1], 3 * 72), "w": r(72, s[1]), "cu": np.array(s[0]), "C": 72},
       lambda b, i: {"y": b.conv1d_silu(A(b, i["x"])[:, i["C"]:2 * i["C"]], A(b, i["w"]), i["cu"])},
       on_gpu(1e-5)),
    Op("gdn_gates", ((1, 8), (65, 8), (300, 32)),
       lambda s: {"a": r(*s, scale=10), "b": r(*s), "al": r(s[1]), "dt": r(s[1])},
       lambda b, i: dict(zip(("g", "beta"), b.gdn_gates(*(A(b, i[n]) for n in ("a", "b", "al", "dt"))))),
       lambda row, i, ref: {"g": on_gpu(1e-5)(row, i, ref), "beta": on_gpu(1e-6)(row, i, ref)}),
    Op("gated_delta_rule", tuple((*s, None) for s in itertools.product(GDN_CU, GDN_SHAPES, (False, True)))
       # slow decay at the model's head size; clef-flash's heads (16 key, 32 value heads of 128) at 2,048 tokens
       + tuple(([0, 300], (1, 2, 128, 128), True, d) for d in (0.002, 0.02, 0.3))
       + (DeviceOnly(([0, 1000, 2048], (16, 32, 128, 128), True, None)),),
       _gdn_inputs, _gdn, delta_rule_bound(_gdn), varies="delta"),
    Op("gated_delta_rule into a state view", (([0, 65, 130], (1, 2, 128, 128), True, None),), _gdn_inputs,
       _gdn_state_view, delta_rule_bound(_gdn_state_view), varies="delta"),
    Op("gated_delta_rule over two calls", tuple(([0, 200, 270], (1, 2, 128, 128), True, None, split)
                                                for split in (1, 37, 63, 64, 65, 129)),
       _gdn_inputs, _gdn_two_calls, delta_rule_bound(_gdn_two_calls), varies="delta"),
    # one token's row, not one value: a lone output near 0 (gelu(-3.4) ~ -1e-3) would measure the last bits of
    # erf against itself rather than the kernel
    Op("gelu", ((1, 32), (65, 32), (63, 77)), lambda s: {"x": r(*s, scale=3.0)},
       lambda b, i: {"y": b.gelu(A(b, i["x"]))}, on_gpu(1e-6)),
    Op("sigmoid", ((1, 32), (65, 32), (63, 77)), lambda s: {"x": r(*s)},
       lambda b, i: {"y": b.sigmoid(A(b, i["x"]))}, on_gpu(1e-6)),
    Op("normalize", ((1, 32), (65, 32), (63, 77)), lambda s: {"x": r(*s)},
       lambda b, i: {"y": b.normalize(A(b, i["x"]), 1e-8)}, on_gpu(1e-6)),
    Op("span_means", ((1, [0], [1]), (65, [0, 5, 60], [1, 30, 65]), (300, [0, 17, 299], [17, 299, 300])),
       lambda s: {"x": r(s[0], 32), "st": np.array(s[1]), "en": np.array(s[2])},
       lambda b, i: {"y": b.span_means(A(b, i["x"]), i["st"], i["en"])}, on_gpu(1e-6)),
    Op("segment_softmax_sum", ((1,), (2, 3, 4), (1, 63, 65, 2, 30)), _segments,
       lambda b, i: {"y": b.segment_softmax_sum(A(b, i["sc"]), A(b, i["vals"]), i["own"], i["n"])},
       on_gpu(1e-6)),
    Op("mha", (([7], [65], False), ([1], [1], True), ([7, 1, 3], [65, 63, 1], True), ([2, 300], [130, 17], True)),
       _mha_inputs, _mha,
       on_gpu(4e-3), paths=("split", "split8"), varies="gemm"),
    Op("patch_rows", ([(32, 32)], [(64, 96)], [(32, 32), (96, 64), (1024, 1024)], []),
       lambda s: {"imgs": [RNG.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in s]},
       lambda b, i: {"rows": b.patch_rows(i["imgs"])}, lambda row, i, ref: 0.0),   # one IEEE division each side
    Op("vision_attention", (([0, 1], 3, 16), ([0, 63], 16, 72), ([0, 4, 68, 1092], 3, 72), ([0, 65, 195], 2, 64)),
       _vision_attention_inputs,
       lambda b, i: {"y": b.vision_attention(A(b, i["x"]), b.weight(i["qkv_w"]), A(b, i["qkv_b"]),
                                             b.weight(i["proj_w"]), A(b, i["proj_b"]), i["heads"], A(b, i["cos"]),
                                             A(b, i["sin"]), i["cu"])},
       block_bound, paths=VISION_BLOCK_PATHS, varies="gemm"),
    # I = 8: matrices with a side under 16 stay fp32 (the small-matrix path, then fp32 into fc2)
    Op("vision_mlp", tuple((M, H, I) for M in (1, 63, 65, 300) for H, I in ((72, 200), (48, 8))), _vision_mlp_inputs,
       lambda b, i: {"y": b.vision_mlp(A(b, i["x"]), b.weight(i["w1"]), A(b, i["b1"]), b.weight(i["w2"]),
                                       A(b, i["b2"]))},
       block_bound, paths=VISION_BLOCK_PATHS, varies="gemm"),
]


def _cases():
    """Row by row, size by size, every backend: one size's inputs, reference and bounds serve its backends."""
    for op in OPS:
        for k, size in enumerate(op.sizes):
            for spec in BACKENDS:
                if op.runs_on(spec) and not (spec.build == "numpy" and isinstance(size, DeviceOnly)):
                    yield pytest.param(spec, op.name, k, marks=spec.marks(), id=f"{spec.id}-{op.name}-{k}")


BY_NAME = {op.name: op for op in OPS}


@lru_cache(maxsize=2)
def _drawn(name, k):
    """The inputs and the reference of a row's k-th size, the same for every backend: drawn from a seed of the
    row and the size (a failure reruns as it failed)."""
    op, seed = BY_NAME[name], zlib.crc32(f"{name} {k}".encode())
    RNG.bit_generator.state = np.random.default_rng(seed).bit_generator.state
    inp = op.make(op.sizes[k])
    return seed, inp, op.call(REF, inp)


@lru_cache(maxsize=8)
def _bound(name, k, row):
    """The bounds of a row's k-th size on a precision row ({output: (bound, floor)}); the error model's run once."""
    _, inp, ref = _drawn(name, k)
    return _bounds(BY_NAME[name].bound(row, inp, ref), ref)


def _bounds(bound, names):
    """{output: (bound, floor)} from what a row's bound returned."""
    if not isinstance(bound, dict):
        bound = dict.fromkeys(names, bound)
    return {n: b if isinstance(b, tuple) else (b, 0.0) for n, b in bound.items()}


@pytest.mark.parametrize("spec,name,k", list(_cases()))
def test_op(spec, name, k):
    b, (op, size) = backend(spec), (BY_NAME[name], BY_NAME[name].sizes[k])
    assert b.plan.path == spec.path, f"{spec.id} runs {b.plan.path}"
    row = precision.TABLE[spec.path]
    if spec.build != "numpy":   # the delta rule the switches select: its error model gives the bound
        assert {s.name for s in b.ctx.switches} == {spec.kernels} - {""}, f"{spec.id} runs {b.ctx.switches}"
        row = replace(row, delta_rule=b.gdn_kernels())
    seed, inp, ref = _drawn(name, k)
    print(f"seed {seed}")
    got = {n: b.to_host(a) for n, a in op.call(b, inp).items()}
    assert got.keys() == ref.keys()
    for out, (bound, floor) in _bound(name, k, row).items():
        e = wy.rel(got[out], ref[out], floor)      # max |got - ref| / max(max |ref|, floor)
        print(f"ERR {spec.id} {name} {size} {out} {e:.3e} (bound {bound:.1e})")
        assert e <= bound, f"{name} {out} at {size} on {spec.id}: max rel error {e:.3e} > {bound:.1e}"
