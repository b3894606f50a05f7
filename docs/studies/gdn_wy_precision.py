"""Which operands the WY-form delta rule (cuda/gated_delta_wy.cu) may round, per precision
mode, before any kernel ran: numpy emulations of its products (tests/gdn_wy_model.py) against the exact recurrence.

Part 1, random inputs at clef-flash's head shapes (16 key heads, 32 value heads, 128 x 128) and at the golden
checkpoints' (2 / 4 heads of 16; 2 / 2 heads of 32), of the model's kind (q, k L2-normalised, q scaled, beta a
sigmoid, g a non-positive log-decay of a given mean per token): each candidate's output and final-state error,
max |x - exact| / max |exact|, the exact recurrence being the model in float64 with fp32 products. For scale, the
same for the fp32 numpy reference (clefcore.backends.cpu.gated_delta_rule) and for the one-pass folded rule the
GPU ran before (gdn_fp16_model.py, beside this study). The three-pass folded kernels were fp32-grade: the numpy
reference stands for them.

Part 2, the golden text fixtures (tests/golden) through the whole model with fast's other roundings emulated
(every GEMM's activation rounded once to fp16 against fp16 weights, the SwiGLU product stored in fp16, the causal
attention's q, K, V and probabilities in fp16) and each delta rule in turn: the worst probability error against
the fixtures, the figure fast's golden test reports (on the H100: 6.37e-3 with the three-pass rule, 8.1e-3 to
9.0e-3 with the one-pass rule, docs/bench/2026-12-06-h100-fast-delta-rule-margin/). The emulation's own
agreement with those two figures says how far its other figures can be trusted. Exact: every GEMM in fp32 and
the exact candidate.

Run with clefcore installed, from anywhere: python docs/studies/gdn_wy_precision.py [OUT.json] [--quick].
Writes gdn_wy_precision.json beside this file by default; --quick runs fewer draws (a smoke run, not the record).

What gdn_wy_precision.json says (medians; 2,048 tokens of 128 x 128 heads, decays 0.002 / 0.02 / 0.3 per token):
* The state's roundings are what accumulate. Rounding the recurrence's products (W S, K^T Vd) once puts the final
  state 3.8e-4..4.7e-4 off, as far as the folded one-pass kernels (4.1e-4..4.4e-4); K^T Vd alone in fp16
  3.7e-4..3.9e-4, W S alone 8e-7..1.4e-4 (the more, the longer the state lives); K K^T in fp16 (through the solve)
  4e-5..1e-4. Split, all three keep the state fp32-grade (3.5e-7..8e-7; the numpy reference's own 3.1e-7..8.3e-7).
* The output's products (Q S_in, Q K^T, P V') reach one output once: in fp16 they put the output 3.3e-4..4.2e-4 off
  (one rounding), the state untouched.
* Golden, fast emulated (12 runs each): worst |dp| median 7.1e-3 with the fp32 rule (the H100 measured 6.37e-3 with
  today's three-pass kernels: inside the emulation's 5.3e-3..9.9e-3), 1.40e-2 with the folded one-pass rule (the
  H100: 8.1e-3..9.0e-3; the emulation overstates it but ranks it as the H100 did); WY exact 6.3e-3, WY with the
  state split and the outputs in fp16 6.1e-3, rms |dp| 1.61e-3 against the fp32 rule's 1.78e-3 (+-1.3e-4 run to
  run). WY all in fp16 also 5.1e-3 / 1.61e-3 here, but its state is 1,000 times further off at the model's size.
* Hence fast (gated_delta_wy_fast.cu, tests/gdn_wy_model.py FAST): K K^T, W S, K^T Vd split; Q S_in, Q K^T, P V'
  in one pass: the state as accurate as today's three-pass kernels, the output rounded once, a third of the
  output products' tensor-core work and the entering state stored in fp16 alone. Exact (gated_delta_wy.cu): every
  product split, output 1e-6..3e-6 (the fp16 lo halves of the small q values are subnormal), state as fp32;
  golden with fp32 elsewhere worst |dp| 1.5e-5 (numpy fp32 4.5e-6), far inside exact's 2e-4.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gdn_fp16_model as folded  # noqa: E402
import gdn_wy_model as wy  # noqa: E402
import golden_runs  # noqa: E402  (docs/studies, beside this file)

from clefcore.backends import cpu  # noqa: E402

Op = wy.Operands
# name -> Operands (kk, ws, ku, qs, qk, pv)
CANDIDATES = {
    "wy exact (all split)": wy.EXACT,
    "wy fast (kk, scan split; out fp16)": wy.FAST,
    "wy kk fp16; scan split; out fp16": Op("fp16", "split", "split", "fp16", "fp16", "fp16"),
    "wy kk, ws split; ku fp16; out fp16": Op("split", "split", "fp16", "fp16", "fp16", "fp16"),
    "wy kk, ku split; ws fp16; out fp16": Op("split", "fp16", "split", "fp16", "fp16", "fp16"),
    "wy scan fp16; kk, out split": Op("split", "fp16", "fp16", "split", "split", "split"),
    "wy kk, scan, qs split; qk, pv fp16": Op("split", "split", "split", "split", "fp16", "fp16"),
    "wy kk, scan, qk split; qs, pv fp16": Op("split", "split", "split", "fp16", "split", "fp16"),
    "wy kk, scan, pv split; qs, qk fp16": Op("split", "split", "split", "fp16", "fp16", "split"),
    "wy kk, scan, qs, pv split; qk fp16": Op("split", "split", "split", "split", "fp16", "split"),
    "wy kk, scan, qs, qk split; pv fp16": Op("split", "split", "split", "split", "split", "fp16"),
    "wy one pass (all fp16)": Op.all("fp16"),
}
REFERENCES = {
    "numpy fp32 (cpu.py; ~ today's three-pass kernels)": lambda *a: cpu.gated_delta_rule(*a),
    "folded one pass (today's gdn_one_pass, tests/gdn_fp16_model.py)": lambda *a: folded.gated_delta_rule(*a),
}


def _candidate(ops: wy.Operands):
    return lambda *a: wy.gated_delta_rule(*a, operands=ops)


RULES = {**REFERENCES, **{name: _candidate(ops) for name, ops in CANDIDATES.items()}}
# part 2 (the whole model, many runs each) takes the references and the candidates that decide
GOLDEN_FAST = list(REFERENCES) + ["wy exact (all split)", "wy fast (kk, scan split; out fp16)",
                                  "wy kk fp16; scan split; out fp16", "wy one pass (all fp16)"]
GOLDEN_EXACT = ["numpy fp32 (cpu.py; ~ today's three-pass kernels)", "wy exact (all split)"]

# (key heads, value heads, head dim, tokens, packed sequence lengths or None)
SHAPES = {"model 128x128, 2048 tokens": (16, 32, 128, 2048, None),
          "golden text 16x16, 686 tokens": (2, 4, 16, 686, None),
          "golden text 16x16, packed 1/63/65/130/300": (2, 4, 16, None, (1, 63, 65, 130, 300)),
          "golden images 32x32, 686 tokens": (2, 2, 32, 686, None)}
DECAYS = (0.002, 0.02, 0.3)   # mean -g per token: 0.13, 1.3 and 19 nats per 64-token chunk


def _l2(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def draw(rng, hk, hv, d, cu, decay):
    T = int(cu[-1])
    q = (_l2(rng.standard_normal((T, hk, d))) / math.sqrt(d)).astype(np.float32)
    k = _l2(rng.standard_normal((T, hk, d))).astype(np.float32)
    v = rng.standard_normal((T, hv, d)).astype(np.float32)
    g = (-decay * rng.exponential(1.0, (T, hv))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((T, hv))))).astype(np.float32)
    S0 = (0.5 * rng.standard_normal((len(cu) - 1, hv, d, d))).astype(np.float32)
    return (q, k, v, g, beta), S0


def rel(x, ref):
    ref = np.asarray(ref, np.float64)
    return float(np.max(np.abs(np.asarray(x, np.float64) - ref)) / np.max(np.abs(ref)))


def part1(draws: int) -> dict:
    out = {}
    for shape, (hk, hv, d, T, lens) in SHAPES.items():
        cu = np.array([0, T]) if lens is None else np.concatenate([[0], np.cumsum(lens)])
        n = max(1, draws // 4) if d == 128 else draws
        for decay in DECAYS:
            key = f"{shape}, decay {decay}/token"
            errs = {name: {"out": [], "state": []} for name in RULES}
            t0 = time.time()
            for seed in range(n):
                rng = np.random.default_rng([seed, int(decay * 1e4), d, int(cu[-1])])
                args, S0 = draw(rng, hk, hv, d, cu, decay)
                S_true = S0.astype(np.float64)
                true = wy.gated_delta_rule(*args, cu, S_true, operands=wy.FP32, dtype=np.float64)
                for name, rule in RULES.items():
                    S = S0.copy()
                    o = rule(*args, cu, S)
                    errs[name]["out"].append(rel(o, true))
                    errs[name]["state"].append(rel(S, S_true))
            out[key] = {name: {"draws": n, "out_median": float(np.median(e["out"])), "out_max": max(e["out"]),
                               "state_median": float(np.median(e["state"])), "state_max": max(e["state"])}
                        for name, e in errs.items()}
            print(f"{key} ({n} draws, {time.time() - t0:.0f} s)")
            for name, e in out[key].items():
                print(f"  {name:66s} out {e['out_median']:.2e} (max {e['out_max']:.2e})  "
                      f"state {e['state_median']:.2e} (max {e['state_max']:.2e})")
    return out


# --------------------------------------------------------------------------------------------------- part 2
def _h(x):
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


class FastEmulation(cpu.CpuOps):
    """The numpy backend with the fast plan's roundings outside the delta rule (see the module doc)."""

    def __init__(self, rule, fast=True, seed=None):
        super().__init__()
        self.gated_delta_rule = rule
        self.fast = fast
        self.noise = None if seed is None else np.random.default_rng(seed)

    def _jitter(self, y):
        """y (1 + e), e ~ N(0, 2^-24): fp32 sums taken in another order, so that each seed is one draw of where
        fast's fp16 roundings fall (one draw alone says little: an fp32-level change moves the worst error by
        tens of per cent)."""
        if self.noise is None:
            return y
        return (y * (1 + self.noise.standard_normal(y.shape) * 2.0 ** -24)).astype(np.float32)

    def weight(self, w):
        w = super().weight(w)
        return _h(w) if self.fast and w.ndim == 2 and min(w.shape) >= 16 else w   # CudaOps.weight's fp16 matrices

    def linear(self, x, w, b=None):
        return self._jitter(cpu.linear(_h(x) if self.fast else x, w, b))

    def mlp(self, x, w_gate, w_up, w_down):
        if not self.fast:
            return cpu.mlp(x, w_gate, w_up, w_down)
        x = _h(x)
        return self._jitter(_h(cpu.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T)   # gemm_swiglu_f32a writes fp16

    def attention(self, q, k, v, cu_seqlens, scale, q_offset=0):
        if not self.fast:
            return cpu.attention(q, k, v, cu_seqlens, scale, q_offset)
        q, k, v = _h(q), _h(k), _h(v)
        n, hq, _ = q.shape
        group = hq // k.shape[1]
        out = np.empty((n, hq, v.shape[2]), np.float32)
        for s0, s1 in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            a, e = max(int(s0), q_offset), min(int(s1), q_offset + n)
            if a >= e:
                continue
            kk = np.repeat(k[s0:e], group, axis=1).transpose(1, 2, 0)
            vv = np.repeat(v[s0:e], group, axis=1).transpose(1, 0, 2)
            qq = q[a - q_offset:e - q_offset].transpose(1, 0, 2)
            sc = (qq @ kk) * np.float32(scale)
            rows = np.arange(a - s0, e - s0)[:, None]
            sc = np.where(np.arange(e - s0)[None, :] <= rows, sc, -np.inf)
            p = np.exp(sc - sc.max(axis=-1, keepdims=True))
            out[a - q_offset:e - q_offset] = ((_h(p) @ vv) / p.sum(axis=-1, keepdims=True)).transpose(1, 0, 2)
        return out

    def mha(self, xq, xkv, in_w, in_b, out_w, out_b, heads, groups=None, group_ids=None):
        if not self.fast:
            return cpu.mha(xq, xkv, in_w, in_b, out_w, out_b, heads, groups, group_ids)
        # the head's projections are GEMMs (activation rounded); its scores and mix are fp32 (CudaOps.mha)
        W = xq.shape[-1]
        o = cpu.mha(_h(xq), _h(xkv), in_w, in_b, np.eye(W, dtype=np.float32), np.zeros(W, np.float32), heads,
                    groups, group_ids)
        return self.linear(o, out_w, out_b)

    # the vision tower (requests with images; fp8_gemm.py runs the image set): CudaOps.vision_mlp's GELU pass
    # writes fc2's operand in fp16, every projection takes its operand in fp16; the tower's attention itself stays
    # fp32 here (the kernels read q, K, V in fp16: not emulated, no study here varies the tower)
    def vision_mlp(self, x, w1, b1, w2, b2):
        return self.linear(cpu.gelu_tanh(self.linear(x, w1, b1)), w2, b2)

    def vision_attention(self, x, qkv_w, qkv_b, proj_w, proj_b, heads, cos, sin, cu_seqlens):
        W = x.shape[-1]
        o = cpu.vision_attention(_h(x) if self.fast else x, qkv_w, qkv_b, np.eye(W, dtype=np.float32),
                                 np.zeros(W, np.float32), heads, cos, sin, cu_seqlens)
        return self.linear(o, proj_w, proj_b)


def part2(seeds: int) -> dict:
    def errors(ops):
        """Every question's max |dp| over its options, for the golden text requests one by one."""
        dps = golden_runs.abs_dp(golden_runs.load(golden_runs.SETS["text"], ops))
        return np.array([float(d.max()) for d in dps])

    out = {"seeds": seeds, "fast": {}, "exact": {}}
    for mode, names in (("fast", GOLDEN_FAST), ("exact", GOLDEN_EXACT)):
        for name in names:
            t0 = time.time()
            runs = [errors(FastEmulation(RULES[name], fast=mode == "fast", seed=s)) for s in range(seeds)]
            worst = np.array([r.max() for r in runs])
            rms = np.array([np.sqrt(np.mean(r ** 2)) for r in runs])
            out[mode][name] = {"worst_median": float(np.median(worst)), "worst_max": float(worst.max()),
                               "worst_min": float(worst.min()), "rms_mean": float(rms.mean()),
                               "rms_sd": float(rms.std(ddof=1)), "worst": [float(w) for w in worst],
                               "rms": [float(x) for x in rms]}
            e = out[mode][name]
            print(f"golden, {mode} emulated, {name:66s} worst |dp| median {e['worst_median']:.2e} "
                  f"[{e['worst_min']:.2e}, {e['worst_max']:.2e}], rms {e['rms_mean']:.2e} +- {e['rms_sd']:.1e} "
                  f"({time.time() - t0:.0f} s)")
    return out


def main(argv):
    quick = "--quick" in argv
    paths = [a for a in argv if not a.startswith("--")]
    path = Path(paths[0]) if paths else Path(__file__).with_suffix(".json")
    result = {"candidates": {name: vars(ops) for name, ops in CANDIDATES.items()},
              "errors": "max |x - exact| / max |exact| (exact: float64 recurrence); median and max over draws",
              "random": part1(2 if quick else 8), "golden_dp": part2(3 if quick else 12)}
    if not quick:
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
