"""The CUDA backend's settings a user picks (``--gemm``, ``--token-block``, ``--graph-tokens``): their choices and
defaults, defined once here, below both the backend that runs them and clefcore/options.py's ``EngineOptions``
that parses them. Precision's names are clefcore/precision.py's; the kernel switches are clefcore/switches.py's;
the GEMM routes are clefcore/kernel_select.py's."""

from __future__ import annotations

from .kernel_select import GEMM_PINS, GemmRoute

GEMM_AUTO = "auto"       # a per-shape timing at load picks; else always the route named
GEMM_CHOICES = (GEMM_AUTO,) + tuple(r.value for r in GEMM_PINS)
GEMM_DEFAULT = GEMM_AUTO
TOKEN_BLOCK = 4096     # tokens per block of the layer-outer prefill (0: the whole stream)
GRAPH_TOKENS = 1024    # prompts (and fast-mode tower inputs) of up to this many tokens replay a CUDA graph (0: off)


def gemm_pin(text: str) -> GemmRoute | None:
    """``--gemm``'s value -> the route every GEMM is pinned to, or None for auto."""
    if text not in GEMM_CHOICES:
        raise ValueError(f"gemm must be one of {', '.join(GEMM_CHOICES)}, got {text!r}")
    return None if text == GEMM_AUTO else GemmRoute(text)
