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
