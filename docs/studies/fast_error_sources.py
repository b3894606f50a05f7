"""Where fast's golden error comes from: the fast plan emulated in numpy, one GEMM family at a time.

fast differs from exact in one thing: each weight GEMM's fp32 activation is rounded once to fp16 (exact splits it
into hi + lo halves). The causal attention reads q, K, V and P in fp16 on every path, and the delta rule runs
three passes (fp32-grade) in both modes, so they are common to both. This study runs the CPU engine's ops with
the fp16 rounding of the GEMM activations of chosen families only, on the text golden set
(tests/golden/expected.jsonl, the fp32 reference), and prints the worst and the mean |dp| for: every family
rounded (fast's emulation, to compare with the GPU's 6.3e-3..6.6e-3), each family alone, and every family but one.

Families: backbone "attn_proj" (q/k/v/gate and o projections of the full-attention layers); the Gated DeltaNet's
input projection by its output columns, "gdn_qk" and "gdn_v" (the conv's input: keys and queries, values),
"gdn_z" (the output gate), "gdn_ab" (the decay and beta gates' inputs: 2 x value heads columns), and its output
projection "gdn_out"; "mlp_in" (gate and up), "mlp_down" (down's input: silu(gate) * up),
"head" (the joint head's linears and its attention's projections), plus "attention" (q, K, V and P in fp16, as
the kernels read them on every path).

Run: python docs/studies/fast_error_sources.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

import golden_runs   # docs/studies, beside this file
from clefcore.backends import cpu
from clefcore.backends.cpu import CpuOps

FAMILIES = ("attn_proj", "gdn_qk", "gdn_v", "gdn_z", "gdn_ab", "gdn_out", "mlp_in", "mlp_down", "head", "attention")


def h(x):
    """One rounding to fp16 and back: what a GEMM's tensor cores see of an fp32 activation in fast mode."""
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


class Emulated(CpuOps):
    """CpuOps with fp16 rounding of the activations of the families in ``rounded``. A linear is filed by its
    caller's module (model.head: "head") and, in the backbone, by the weight's name in Params (set before each
    forward in ``names``)."""

    def __init__(self, rounded: set[str], names: dict[int, str]):
        super().__init__()
        self.rounded, self.names = rounded, names
        self.gdn_cols = (0, 0, 0)  # the input projection's q+k, conv and z widths (set once the config is read)

    def _family(self, w) -> str:
        caller = sys._getframe(2).f_globals.get("__name__", "")
        if caller.endswith("model.head"):
            return "head"
        name = self.names.get(id(w), "")
        if ".self_attn." in name:
            return "attn_proj"
        return "gdn_in" if name.endswith("in_proj.weight") else "gdn_out"

    def linear(self, x, w, b=None):
        family = self._family(w)
        if family != "gdn_in":
            return cpu.linear(h(x) if family in self.rounded else x, w, b)
        exact, rounded = cpu.linear(x, w, b), cpu.linear(h(x), w, b)
        qk, cd, zd = self.gdn_cols
        for name, cols in (("gdn_qk", slice(0, qk)), ("gdn_v", slice(qk, cd)), ("gdn_z", slice(cd, cd + zd)),
                           ("gdn_ab", slice(cd + zd, None))):
            if name in self.rounded:
                exact[:, cols] = rounded[:, cols]
        return exact

    def mlp(self, x, w_gate, w_up, w_down):
        x = h(x) if "mlp_in" in self.rounded else x
        mid = cpu.silu(x @ w_gate.T) * (x @ w_up.T)
        return (h(mid) if "mlp_down" in self.rounded else mid) @ w_down.T

    def mha(self, xq, xkv, in_w, in_b, out_w, out_b, heads, groups=None, group_ids=None):
        if "head" not in self.rounded:
            return cpu.mha(xq, xkv, in_w, in_b, out_w, out_b, heads, groups, group_ids)
        # the projections' inputs rounded; the out-projection's input rounded as well (its own GEMM)
        o = cpu.mha(h(xq), h(xkv), in_w, in_b, np.eye(out_w.shape[1], dtype=np.float32),
                    np.zeros(out_w.shape[1], np.float32), heads, groups, group_ids)
        return cpu.linear(h(o), out_w, out_b)

    def attention(self, q, k, v, cu_seqlens, scale, q_offset=0):
        if "attention" not in self.rounded:
            return cpu.attention(q, k, v, cu_seqlens, scale, q_offset)
        return cpu.attention(h(q), h(k), h(v), cu_seqlens, scale, q_offset)   # P stays fp32 here (see below)


def errors(rounded: set[str]) -> tuple[float, float]:
    """(worst, mean) |dp| over every option of every golden question."""
    names: dict[int, str] = {}
    ops = Emulated(rounded, names)
    m = golden_runs.load(golden_runs.SETS["text"], ops)
    names.update(golden_runs.weight_names(m.params))
    t = m.checkpoint.text
    ops.gdn_cols = (2 * t.lin_k_heads * t.lin_k_dim, t.conv_dim, t.lin_v_heads * t.lin_v_dim)
    diffs = np.concatenate(golden_runs.abs_dp(m))
    return float(np.max(diffs)), float(np.mean(diffs))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    gemms = set(FAMILIES) - {"attention"}
    out = {"none": errors(set()), "fast (every GEMM family)": errors(gemms),
           "fast + attention": errors(set(FAMILIES))}
    for f in FAMILIES:
        out[f"only {f}"] = errors({f})
    for f in sorted(gemms):
        out[f"fast without {f}"] = errors(gemms - {f})
    conv_in = {"gdn_qk", "gdn_v"}    # every column that feeds the conv
    out["only gdn_qk, gdn_v"] = errors(conv_in)
    out["fast without gdn_qk, gdn_v"] = errors(gemms - conv_in)
    print(f"{'rounded to fp16':32s} {'worst |dp|':>10s} {'mean |dp|':>10s}")
    for k, (worst, mean) in out.items():
        print(f"{k:32s} {worst:10.3e} {mean:10.3e}")
    out = {k: {"worst": w, "mean": m} for k, (w, m) in out.items()}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
