"""Kernel switches: GPU kernel variants chosen by name, defined here and nowhere else.

A switch selects between two validated ways of computing the same op (different speed or rounding, never a
different result beyond its precision mode's contract). A variant that has not yet passed the GPU suite and the
golden sets on a GPU ships off by default. Each switch is set, from strongest to weakest, by the ``kernels``
option (``clefcore.load(..., kernels="name,other=off")``, ``--kernels`` on every command that loads an engine),
by its environment variable (``CLEFCORE_<NAME>=1`` or ``0``), or by its default. ``clefcore bench`` records the
switches in effect in its JSON.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Switch:
    name: str
    default: bool
    help: str

    @property
    def env(self) -> str:
        return "CLEFCORE_" + self.name.upper()


SWITCHES = (
    # Off: on the H100 the one-pass rule took fast's worst golden error from 6.4e-3 to 9.0e-3 (of a 1e-2
    # contract) for 3-4 % at 8,192 tokens and packed (docs/bench/2026-12-06-h100-fast-delta-rule-margin/).
    Switch("gdn_one_pass", False,
           "fast precision: the delta rule in one fp16 tensor-core pass per product (cuda/gated_delta_fast.cu) "
           "instead of three (hi/lo halves, as the exact plans run it): 3-4 % faster from 8,192 tokens on the "
           "H100, fast's golden error 9.0e-3 instead of 6.4e-3"),
    # Off until the GPU suite and the golden sets have run it: written and compiled (sm_90a, no spills) without a GPU
    Switch("attn_wgmma", False,
           "causal attention of head dim 256 on compute capability 9.0 (H100, H200) with warpgroup MMAs "
           "(cuda/attention_wgmma.cu) instead of attention.cu's mma.sync kernel, same roundings; "
           "not yet run on a GPU"),
    # Off until it has run on a GPU: written and desk-checked without one (tests/test_fused_elementwise_gpu.py).
    Switch("fused_elementwise", False,
           "fast precision: the RMSNorms, the attention's output gate and the MLP's SwiGLU write the next weight "
           "GEMM's fp16 operand themselves (gate and up projections with SwiGLU in one gemm_mma.cu / gemm_wgmma.cu "
           "kernel) instead of an fp32 activation that a cast pass or the GEMM rounds: the same bits, less memory "
           "traffic; not yet run on a GPU"),
    # Off until a GPU run has checked it: written without a device, its tests and bench comparison not yet run.
    Switch("head_graph", False,
           "the joint head's launches captured in a CUDA graph once per question schema and 128-token bucket "
           "of the stream's length (positions are data, so requests whose states differ in length share one) "
           "and replayed, instead of its hundreds of launches from Python (its attention products through cuBLAS "
           "callable in a capture, its per-question softmax sum in one deterministic kernel instead of CuPy's "
           "scatter atomics); not yet run on a GPU"),
    # Off until a GPU has run it: written and checked against its numpy error model (tests/gdn_wy_model.py) only
    Switch("gdn_wy", False,
           "the delta rule in the WY form (cuda/gated_delta_wy.cu: per chunk U and W from one triangular solve, then "
           "V' = U - W S and the state update over the chunks, then the outputs per chunk) instead of the folded "
           "form (cuda/gated_delta.cu), in every GPU precision (it wins over gdn_one_pass): exact splits every "
           "product; fast splits the state's and rounds the output's once (docs/studies/gdn_wy_precision.py). "
           "Not yet run on a GPU"),
)
BY_NAME = {s.name: s for s in SWITCHES}
_TRUE, _FALSE = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


def _flag(text: str, where: str) -> bool:
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise ValueError(f"{where}: {text!r} is not on or off (1/0, on/off, true/false, yes/no)")


def parse(spec: str) -> dict[str, bool]:
    """``"a,b=off"`` -> {"a": True, "b": False}. Unknown names and values are refused, naming the choices."""
    out = {}
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in BY_NAME:
            raise ValueError(f"kernels: unknown switch {name!r}; the switches are {', '.join(BY_NAME)}")
        out[name] = _flag(value, f"kernels {name}") if value else True
    return out


def resolve(spec: str | None = None, environ=None) -> frozenset[str]:
    """The names of the switches that are on: ``spec`` (the kernels option), else each switch's environment
    variable, else its default."""
    environ = os.environ if environ is None else environ
    given = parse(spec) if spec else {}
    on = set()
    for s in SWITCHES:
        if s.name in given:
            value = given[s.name]
        elif environ.get(s.env, "").strip():
            value = _flag(environ[s.env], s.env)
        else:
            value = s.default
        if value:
            on.add(s.name)
    return frozenset(on)


def describe() -> str:
    """One line per switch, for --help."""
    return "; ".join(f"{s.name} (default {'on' if s.default else 'off'}, ${s.env}): {s.help}" for s in SWITCHES)
