"""Kernel switches: GPU kernel variants chosen by name, defined here and nowhere else.

A switch selects between two validated ways of computing the same op (different speed or rounding, never a
different result beyond its precision mode's contract). A variant that has not yet passed the GPU suite and the
golden sets on a GPU ships off by default; once it has, and is faster, it becomes what the backend runs and its
switch goes, unless both sides stay live choices. Each switch is set, from strongest to weakest, by the ``kernels``
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


# Each switch is a module constant here (``SOME_KERNEL = Switch(...)``), listed in SWITCHES; clefcore/kernel_select.py
# reads them. attention_wgmma.cu (Hopper), the fused elementwise producers (fast), the head's CUDA graphs and the
# WY-form delta rule ran correct and faster on an H100 (2b7717a) and are what the backend runs, each where it
# applies; so does each CUDA graph's memory in an arena of its own (5226985).
WY_ONE_PASS = Switch(
    "wy_one_pass", False,
    "fast's delta rule with every tensor-core product in one fp16 pass (cuda/gated_delta_wy_one_pass.cu), the "
    "state's recurrence and the solve's K K^T included, which fast otherwise splits into hi + lo halves: a third "
    "of the scan's dependent products per chunk (not yet run on a GPU)")
SWITCHES: tuple[Switch, ...] = (WY_ONE_PASS,)
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


def resolve(spec: str | None = None, environ=None) -> frozenset[Switch]:
    """The switches that are on: ``spec`` (the kernels option), else each switch's environment variable, else its
    default. A choice asks ``SOME_SWITCH in on`` of a module constant (clefcore/kernel_select.py), never a name."""
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
            on.add(s)
    return frozenset(on)


def describe() -> str:
    """One line per switch, for --help."""
    if not SWITCHES:
        return "none at present"
    return "; ".join(f"{s.name} (default {'on' if s.default else 'off'}, ${s.env}): {s.help}" for s in SWITCHES)
