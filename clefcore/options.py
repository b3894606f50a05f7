"""Command-line options shared by every command that loads an engine: ``clefcore decide``/``demo``, ``verify``
and ``serve`` add them to their parsers, and ``backend_options`` turns the parsed values into ``load``'s keyword
arguments."""

from __future__ import annotations

import argparse

from . import precision


def image_options(p: argparse.ArgumentParser) -> None:
    """--no-images, shared by every command that loads a model (decide, demo, serve, verify)."""
    p.add_argument("--no-images", action="store_true",
                   help="text only: leave the vision tower (model.visual.*) unloaded, about 0.9 GB of GPU memory "
                        "on Clef-flash; requests with images are then refused (422, field images)")


def gpu_options(p: argparse.ArgumentParser) -> None:
    """CudaOps options shared by every command that loads an engine (left out on the CPU unless given)."""
    p.add_argument("--precision", choices=precision.CHOICES, default=None,
                   help="GPU precision: fast (default; each activation rounded once to fp16, fp32 accumulation; a "
                        "batch whose per-layer guard trips runs again exactly, counted in /metrics) or exact "
                        "(fp32-grade products: split, or split8 where fp8 tensor cores exist). The kernel paths "
                        "fp16, split and split8 may be named directly")
    p.add_argument("--gemm", choices=("auto", "wmma", "cublas"), default=None,
                   help="GPU GEMM kernels: auto (default; a short per-shape timing at load picks the faster, "
                        "logged), or always clefcore's wmma kernels or always cuBLAS (to rule one out)")
    p.add_argument("--token-block", type=int, default=None,
                   help="GPU prefill block in tokens (default 4096; smaller = less memory, 0 = whole prompt)")
    p.add_argument("--graph-tokens", type=int, default=None,
                   help="GPU: prompts of up to this many tokens, and the vision tower (fast mode) over images of up "
                        "to this many image tokens, replay a CUDA graph (default 1024; 0 = off); each cached graph "
                        "holds its own activations (at most 4 graphs)")


def backend_options(args) -> dict:
    pairs = (("precision", args.precision), ("gemm", args.gemm), ("token_block", args.token_block),
             ("graph_tokens", args.graph_tokens))
    return {k: v for k, v in pairs if v is not None}
