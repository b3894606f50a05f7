"""fp8 (e4m3) weight GEMMs in the fast precision, before any kernel: the backbone's linear layers with both operands
rounded to e4m3 under three scaling schemes, emulated in numpy on top of fast's other roundings, on both golden
sets (text and images), against the fixtures' fp32 probabilities and against fast as it is.

What runs. fast as gdn_wy_precision.FastEmulation has it (every GEMM operand in fp16, the SwiGLU product in fp16,
the causal attention's q, K, V and P in fp16, the fp32-grade delta rule; the tower's GEMM operands in fp16), and
on top the chosen backbone GEMMs with both operands in e4m3 (ml_dtypes.float8_e4m3fn: nearest even, largest 448,
the rounding cuda/fp8.cu makes). Each block of an operand gets the power-of-two scale the split8 path already
gives its fp8 twins (CudaOps.twin, fp8.cu e4m3_scale): 2^floor(log2(448 / amax)). The rounded operands' product
is summed in fp32 and the scales come off exactly. GEMM groups: attn_proj (the full-attention layers' qkv and o),
the Gated DeltaNet's input projection as gdn_conv (the q, k, v columns that feed the conv) and gdn_zab (z and the
two gates' inputs), gdn_out, mlp_in (gate, up), mlp_down (the SwiGLU product against down). The joint head, the
LM-head rows and the vision tower stay as fast has them. The plan: every group but gdn_conv
(fast_error_sources.py found those columns the most sensitive). Schemes: a, weights per output channel and
activations per token; b, both per tensor (dynamic); c, 128 x 128 weight blocks and 1 x 128 activation blocks
(DeepSeek-V3's). The golden models' K (64 and 160) fills one or two 128-wide blocks, so c is nearly a here; c16
(16-wide blocks) is c's granularity relative to clef-flash's K of 4,096. Two variants of a show which operand
costs what: weights alone in e4m3, activations alone.

Findings (fp8_gemm.json; worst |dp| against the fixtures' fp32 probabilities, text set / image set, 57 / 16
questions; ../shared holds byte-identical copies of both sets):
* fast as emulated: 7.16e-3 / 1.49e-3 (on the GPU: 5.3e-3..6.6e-3 on the text set, 1.2e-3..1.9e-3 on the
  images); numpy fp32 4.8e-6 / 1.6e-6.
* The plan in fp8: a 0.570 / 0.190, b 0.541 / 0.191, c 0.574 / 0.190, c16 0.562 / 0.195: 57 and 19 times the
  1e-2 contract, and 4 to 9 of the 57 text questions change their most probable option. Every backbone GEMM
  (with the conv's columns): 0.85..0.89 / 0.13..0.18.
* One group alone in fp8 (a; b and c within 15 %): attn_proj 2.2e-2 / 1.05e-2, gdn_out 0.161 / 0.057,
  mlp_down 0.190 / 0.055, mlp_in 0.262 / 0.080, gdn_zab 0.375 / 0.076, gdn_conv 0.471 / 0.167. Not one stays
  within 1e-2 on the text set, so no smaller fp8 plan exists either; attn_proj, the nearest, is 7 % of
  clef-flash's GEMM work.
* The scales hardly matter (a, b, c, c16 within 6 % on the plan): the error is e4m3's 3-bit mantissa (a relative
  step of 2^-4, against fp16's 2^-11), not its range. Each operand alone already misses (the plan): weights alone
  in e4m3 0.409 / 0.074, activations alone 0.386 / 0.107, so a weight-only fp8 format (for the memory-bound GEMMs
  of short prompts) is out as well.
* Left out, and each could only add error: Hopper's fp8 tensor cores accumulate with fewer bits than fp32 unless
  the partial sums are promoted (cuBLASLt's fast accumulation, which split8 runs, does not promote); at K of 64
  and 160 this is small beside the operands' rounding, at clef-flash's 4,096 and 12,288 it is not. Trained
  weights with outlier channels would also separate the schemes (b worst) more than these random ones do.
* Verdict: fp8 is not built. The margin it needed: an emulated worst of 5e-3 or less, half the contract, because
  the emulated worst moves by up to 1.9x between fp32-level reorderings of one plan (gdn_wy_precision.json: fast
  at 5.3e-3..9.9e-3 over 12 draws), and fast itself already sits at 6.5e-3 on the GPU. fp8 misses that by two
  orders of magnitude.
* What it could have bought (speed_bound_8192): the plan is 88.4 % of clef-flash's backbone GEMM work (the
  conv's columns the other 11.6 %). The H100's 8,192-token fast forward with the four kernel switches on is
  279.6 ms, cuBLAS's GEMMs about 166 ms of it; with that time shared by work and the plan's GEMMs at exactly
  twice the rate, at most 73 ms saved: 206 ms, 1.36x. That bound leaves out the activations' quantisation passes
  and cuBLAS reaching less than twice its fp16 rate at some shapes.

Run: python docs/studies/fp8_gemm.py [OUT.json] (clefcore and ml_dtypes installed; 5 to 9 minutes on 2
cores). Writes fp8_gemm.json beside this file by default.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

import golden_runs  # docs/studies, beside this file
from clefcore import synth
from clefcore.backends import cpu
from clefcore.config import TextConfig
from gdn_wy_precision import FastEmulation

E4M3_MAX = 448.0   # float8_e4m3fn's largest finite value


@dataclass(frozen=True)
class Scheme:
    """One scale per block of (rows, columns) of the operand ([M, K] activation, [N, K] weight), a None in it: the
    whole dimension; an operand None: fp16 as fast has it."""
    activation: tuple[int | None, int | None] | None
    weight: tuple[int | None, int | None] | None


SCHEMES = {
    "a: weights per output channel, activations per token": Scheme((1, None), (1, None)),
    "b: weights and activations per tensor (dynamic)": Scheme((None, None), (None, None)),
    "c: weights in 128x128 blocks, activations in 1x128 blocks": Scheme((1, 128), (128, 128)),
}
VARIANTS = {   # run for the plan alone
    # the golden models' K is 64..160, one or two 128-wide blocks: c at the real model's granularity (K 4096 in 32
    # blocks) is nearer 16-wide blocks here
    "c16: weights in 16x16 blocks, activations in 1x16 blocks": Scheme((1, 16), (16, 16)),
    # which operand's rounding costs what (one operand in fp8 gets no fp8 tensor-core rate)
    "a, weights only (activations fp16)": Scheme(None, (1, None)),
    "a, activations only (weights fp16)": Scheme((1, None), None),
}
# the backbone's GEMMs by what they compute; the Gated DeltaNet's input projection is split by its output columns
GROUPS = ("attn_proj", "gdn_conv", "gdn_zab", "gdn_out", "mlp_in", "mlp_down")
GROUP_OF = {"self_attn.qkv_proj.weight": "attn_proj", "self_attn.o_proj.weight": "attn_proj",
            "linear_attn.in_proj.weight": "gdn_in", "linear_attn.out_proj.weight": "gdn_out",
            "mlp.gate_proj.weight": "mlp_in", "mlp.up_proj.weight": "mlp_in", "mlp.down_proj.weight": "mlp_down"}
PLAN = frozenset(GROUPS) - {"gdn_conv"}     # the candidate: every backbone GEMM but the conv's columns
PLAN_NAME = "fp8 plan (all but the conv's columns)"
CONFIGS = {PLAN_NAME: PLAN, "all backbone GEMMs": frozenset(GROUPS),
           **{f"only {g}": frozenset({g}) for g in GROUPS}}


def e4m3(x, block) -> np.ndarray:
    """x [M, K] rounded to e4m3 with one power-of-two scale per block, back in fp32: the scale cuda/fp8.cu and
    CudaOps.twin use, 2^floor(log2(448 / amax)), so that the block's largest magnitude lands in (224, 448]."""
    x = np.asarray(x, np.float32)
    M, K = x.shape
    br, bc = block[0] or M, block[1] or K
    pm, pk = -M % br, -K % bc
    blocks = np.pad(x, ((0, pm), (0, pk))).reshape((M + pm) // br, br, (K + pk) // bc, bc)
    amax = np.abs(blocks).max(axis=(1, 3), keepdims=True).astype(np.float64)
    s = np.where(amax > 0, np.exp2(np.floor(np.log2(E4M3_MAX / np.where(amax > 0, amax, 1.0)))), 1.0)
    s = s.astype(np.float32)
    q = np.clip(blocks * s, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) / s
    return q.reshape(M + pm, K + pk)[:M, :K]


class Fp8Emulation(FastEmulation):
    """fast (FastEmulation with the fp32 delta rule: fp16 GEMM operands, the SwiGLU product in fp16, fp16
    attention) with the GEMM groups in ``fp8`` taking their operands in e4m3 under ``scheme`` instead: the
    product of the rounded operands summed in fp32 (the power-of-two scales come off exactly). Backbone weights
    are filed by ``attach``; the head and the tower stay as fast runs them."""

    def __init__(self, scheme: Scheme | None = None, fp8: frozenset = frozenset()):
        super().__init__(cpu.gated_delta_rule)
        self.scheme, self.fp8 = scheme, fp8
        self.group: dict[int, str] = {}
        self.conv_dim = 0

    def attach(self, m: golden_runs.Loaded) -> None:
        self.group = {i: GROUP_OF[key] for i, name in golden_runs.weight_names(m.params).items()
                      if (key := name.split(".", 2)[2]) in GROUP_OF}
        self.conv_dim = m.checkpoint.text.conv_dim

    def _gemm(self, group, x, w, b=None):
        if group not in self.fp8:
            return super().linear(x, w, b)
        a, wb = self.scheme.activation, self.scheme.weight
        wq = w if wb is None else e4m3(w, wb)          # w is fp16 already (FastEmulation.weight)
        if a is None:
            return super().linear(x, wq, b)            # the activation in fp16, as fast has it
        y = e4m3(x, a) @ wq.T
        return y if b is None else y + b

    def linear(self, x, w, b=None):
        group = self.group.get(id(w))
        if group != "gdn_in" or not self.fp8 & {"gdn_conv", "gdn_zab"}:
            return self._gemm(group, x, w, b)
        # two weights in an fp8 build (the conv's columns may stay fp16): each its own scales
        cd = self.conv_dim
        return np.concatenate([self._gemm("gdn_conv", x, w[:cd]), self._gemm("gdn_zab", x, w[cd:])], axis=1)

    def mlp(self, x, w_gate, w_up, w_down):
        if not self.fp8 & {"mlp_in", "mlp_down"}:
            return super().mlp(x, w_gate, w_up, w_down)
        # fast writes the SwiGLU product in fp16 for the down GEMM: _gemm's fp16 path rounds it the same way
        return self._gemm("mlp_down", cpu.silu(self._gemm("mlp_in", x, w_gate)) * self._gemm("mlp_in", x, w_up),
                          w_down)


def run(gold: Path, ops) -> tuple[golden_runs.Loaded, list[np.ndarray]]:
    m = golden_runs.load(gold, ops)
    if isinstance(ops, Fp8Emulation):
        ops.attach(m)
    return m, golden_runs.probabilities(m)


def summary(probs, reference, fast) -> dict:
    """worst and mean |dp| against the fixture, worst |dp| against fast, and the questions whose top option moved."""
    dp = np.concatenate([np.abs(p - r) for p, r in zip(probs, reference, strict=True)])
    to_fast = max(float(np.max(np.abs(p - f))) for p, f in zip(probs, fast, strict=True))
    moved = sum(int(np.argmax(p) != np.argmax(r)) for p, r in zip(probs, reference, strict=True))
    return {"worst": float(dp.max()), "mean": float(dp.mean()), "worst_vs_fast": to_fast, "top_moved": moved}


def golden() -> dict:
    out = {}
    for name, gold in golden_runs.SETS.items():
        t0 = time.time()
        m, ref_probs = run(gold, FastEmulation(cpu.gated_delta_rule, fast=False))
        _, fast = run(gold, Fp8Emulation())
        res = {"questions": len(m.reference), "shared_copy_identical": golden_runs.same_as_local(name),
               "fp32 (numpy)": summary(ref_probs, m.reference, fast), "fast": summary(fast, m.reference, fast)}
        for scheme_name, scheme in {**SCHEMES, **VARIANTS}.items():
            res[scheme_name] = {}
            for config, groups in (CONFIGS if scheme_name in SCHEMES else {PLAN_NAME: PLAN}).items():
                _, probs = run(gold, Fp8Emulation(scheme, groups))
                res[scheme_name][config] = summary(probs, m.reference, fast)
        out[name] = res
        print(f"{name} ({res['questions']} questions, {time.time() - t0:.0f} s)")
        for key in ("fp32 (numpy)", "fast"):
            print(f"  {key:60s} worst {res[key]['worst']:.2e}  mean {res[key]['mean']:.2e}")
        for scheme_name in {**SCHEMES, **VARIANTS}:
            print(f"  {scheme_name}")
            for config, e in res[scheme_name].items():
                print(f"    {config:40s} worst {e['worst']:.2e}  mean {e['mean']:.2e}  "
                      f"vs fast {e['worst_vs_fast']:.2e}  top moved {e['top_moved']}")
    return out


# ------------------------------------------------------------------------------------------ the speed bound
# fast at 8192 tokens on an H100 (80GB HBM3), 2b7717a, the attn_wgmma, fused_elementwise, head_graph and gdn_wy
# switches on: the forward, and cuBLAS's GEMMs in its kernel table (ms)
FORWARD_MS, CUBLAS_MS = 279.6, 166.0
FP8_RATE = 2.0   # the H100's dense fp8 tensor rate over its fp16/bf16 rate (1979 / 989 TFLOP/s, SXM)


def speed_bound() -> dict:
    """clef-flash's backbone GEMM work per token by group (multiply-adds), and what fp8 could save of the
    cuBLAS time at most: that time shared by work (same efficiency everywhere), the fp8 groups at exactly
    FP8_RATE times the rate, no quantisation pass, the rest of the forward unchanged."""
    t = TextConfig.from_dict(synth.config_json("clef-flash", vision=False))
    H, n_attn = t.hidden_size, t.layer_types.count("full_attention")
    n_gdn = t.num_layers - n_attn
    qkv = 2 * t.num_heads * t.head_dim + 2 * t.num_kv_heads * t.head_dim       # q with its gate, k, v
    zab = t.lin_v_heads * t.lin_v_dim + 2 * t.lin_v_heads
    macs = {"attn_proj": n_attn * H * (qkv + t.num_heads * t.head_dim),
            "gdn_conv": n_gdn * H * t.conv_dim, "gdn_zab": n_gdn * H * zab,
            "gdn_out": n_gdn * H * t.lin_v_heads * t.lin_v_dim,
            "mlp_in": t.num_layers * H * 2 * t.intermediate_size, "mlp_down": t.num_layers * H * t.intermediate_size}
    total = sum(macs.values())
    share = sum(macs[g] for g in PLAN) / total
    saved = CUBLAS_MS * share * (1 - 1 / FP8_RATE)
    return {"macs_per_token": macs, "share": {g: v / total for g, v in macs.items()}, "plan_share": share,
            "forward_ms": FORWARD_MS, "cublas_ms": CUBLAS_MS, "fp8_rate": FP8_RATE,
            "bound_saved_ms": saved, "bound_forward_ms": FORWARD_MS - saved,
            "bound_speedup": FORWARD_MS / (FORWARD_MS - saved),
            "all_backbone_saved_ms": CUBLAS_MS * (1 - 1 / FP8_RATE)}


def main(argv):
    path = Path(argv[0]) if argv else Path(__file__).with_suffix(".json")
    bound = speed_bound()
    print(f"8192 tokens, H100: the plan's GEMMs are {bound['plan_share']:.1%} of the backbone's GEMM work; at "
          f"{FP8_RATE}x they save at most {bound['bound_saved_ms']:.0f} ms of {FORWARD_MS} "
          f"({bound['bound_forward_ms']:.0f} ms, {bound['bound_speedup']:.2f}x)")
    result = {"schemes": {k: vars(v) for k, v in {**SCHEMES, **VARIANTS}.items()}, "groups": GROUP_OF,
              "plan": sorted(PLAN),
              "dp": "|p - p_fixture| over every option of every question; worst_vs_fast: max |p - p_fast|; "
                    "top_moved: questions whose most probable option differs from the fixture's",
              "golden": golden(), "speed_bound_8192": bound}
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
