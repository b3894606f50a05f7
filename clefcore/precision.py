"""Precision, in three words: the ``precision`` a user sets (``--precision``, ``load(precision=...)``) names a
*mode* (``fast``, ``exact``; the numpy backend's ``fp32``) or pins a kernel *path* (``fp16``, ``split``,
``split8``); a backend runs a *plan*, its path and whether the range-safe scaling is on.

What a path means for each op family is one row of ``TABLE``: how the GEMMs take their activations, which
kernels run the delta rule, which the vision tower's attention, and whether the tower may replay a CUDA graph.
Every op reads its plan's row (``Plan.row``); no other module compares a mode's or a path's name. A new mode or
path starts here: its row, and for a mode what it resolves to.

* ``fast`` (the default on every GPU): each fp32 activation is rounded once to fp16 for the tensor cores, fp32
  accumulation, fp32 residual stream. A batch whose per-layer guard trips (NaN, Inf, all zero: what fp16's range
  cannot hold) runs again through the range-safe exact path (``Engine.forward``).
* ``exact``: each activation enters as hi + lo fp16 halves (``split``), or, where fp8 tensor cores and cuBLASLt
  exist, hi in fp16 and lo in fp8 against fp8 copies of the weights (``split8``).

The expert names ``fp16``, ``split`` and ``split8`` stay valid and pin that kernel path.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

FP32 = "fp32"     # the numpy backend's one mode and path: fp32 throughout
# each mode's kernel path: (without fp8 tensor cores, with them)
MODE_PATHS = {"fast": ("fp16", "fp16"), "exact": ("split", "split8")}
MODES = tuple(MODE_PATHS)
KERNEL_PATHS = ("fp16", "split", "split8")
CHOICES = MODES + KERNEL_PATHS
DEFAULT = "fast"
# What ``clefcore verify`` holds each mode to against the fp32 numpy path: (per-layer relative error of the
# residual stream, probability difference). The probability bar is each mode's contract (fast: 1e-2, several
# times closer than the reference's own bf16 GPU path). fast's residual stream drifts by ~3e-4 per layer (one fp16
# rounding of every GEMM input): 1.02e-2 after clef-flash's 32 layers on the H200, so its layer bar is 3e-2.
VERIFY_BOUND = {"fast": (3e-2, 1e-2), "exact": (2e-3, 2e-3)}


class GemmOperands(Enum):
    """How a GEMM's fp32 activation meets its fp16 weight (fp32 accumulation on every route). An fp16 activation
    (one its producer already rounded) goes in as it is on every path."""

    FP32 = "fp32 products (numpy)"
    FP16 = "rounded once to fp16"
    SPLIT = "hi + lo fp16 halves"
    SPLIT8 = "hi in fp16, lo in fp8 against the weight's fp8 twin"

    @property
    def fp16(self) -> bool:
        """Rounded once to fp16: wmma's gemm_f32a, the mma route (fp16 operands only), cuBLAS on the rounded
        copy; the vision tower's GELU writes fc2's operand in fp16 for the same reason."""
        return self is GemmOperands.FP16

    @property
    def split(self) -> bool:
        """hi + lo fp16 halves, fp32-grade products: wmma's split kernels, two cuBLAS passes (split8: its fp8
        pass where the weight has a twin, split where it has none)."""
        return self in (GemmOperands.SPLIT, GemmOperands.SPLIT8)

    @property
    def fp8_lo(self) -> bool:
        """The lo half in fp8 against the weight's fp8 twin (cuBLASLt; ``CudaOps.twins``)."""
        return self is GemmOperands.SPLIT8


@dataclass(frozen=True)
class DeltaRule:
    """The Gated DeltaNet kernels: ``module`` (None: numpy's fp32 products) and ``passes``, the fewest fp16
    tensor-core passes any of its products runs (1: that product's operands are rounded once to fp16; 3: hi/lo
    halves throughout, fp32-grade). On the GPU the rule runs in the WY form (gdn_wy_prep, gdn_wy_scan, gdn_wy_out:
    V' = U - W S, S <- exp(G_last) S + K^T V'd over the chunks); docs/studies/gdn_wy_precision.py chose each
    mode's operands."""

    module: str | None
    passes: int


DELTA_FP32 = DeltaRule(None, 0)
DELTA_EXACT = DeltaRule("gated_delta_wy.cu", 3)          # every product split
DELTA_FAST = DeltaRule("gated_delta_wy_fast.cu", 1)      # the state's products split, the output's rounded once
DELTA_ONE_PASS = DeltaRule("gated_delta_wy_one_pass.cu", 1)   # every product rounded once (the wy_one_pass switch)


@dataclass(frozen=True)
class Row:
    """What one kernel path runs, per op family.

    mode: the mode the path belongs to (``CudaOps.mode``).
    gemm: how every weight GEMM takes its activation (backends/cuda/matmul.py; the tower's GEMMs too).
    delta_rule: the delta rule's kernels (backends/cuda/delta_rule.py).
    attention_fp16: the vision tower's bidirectional attention runs attention.cu's fp16 kernel, q/k/v written in
        fp16 by the RoPE pass; otherwise fp32 products (the fp16 roundings, reaching the backbone through every
        image token, would exceed exact's bar). The causal attention reads the fp16 K/V cache on every path.
    tower_graphs: the vision tower may replay a CUDA graph (clefcore/model/vision.py); the fp32 attention calls CuPy's
        cuBLAS matmul, which refuses a capture."""

    mode: str
    gemm: GemmOperands
    delta_rule: DeltaRule
    attention_fp16: bool
    tower_graphs: bool

    @property
    def fused_elementwise(self) -> bool:
        """Whether an activation's producer writes the next weight GEMM's fp16 operand itself (the norms before a
        GEMM, the attention's output gate, the MLP's SwiGLU in its gate/up GEMM's epilogue). Only where the GEMMs
        round their operand once to fp16: that rounding moves into the producer, so the bits are those of a
        separate cast."""
        return self.gemm.fp16


TABLE = {
    "fp16": Row("fast", GemmOperands.FP16, DELTA_FAST, attention_fp16=True, tower_graphs=True),
    "split": Row("exact", GemmOperands.SPLIT, DELTA_EXACT, attention_fp16=False, tower_graphs=False),
    "split8": Row("exact", GemmOperands.SPLIT8, DELTA_EXACT, attention_fp16=False, tower_graphs=False),
    FP32: Row(FP32, GemmOperands.FP32, DELTA_FP32, attention_fp16=False, tower_graphs=False),
}


def resolve(name: str, fp8: bool) -> str:
    """A mode or kernel-path name -> the kernel path (fp16, split, split8). ``fp8``: the device has fp8 tensor
    cores (compute capability 8.9+) and cuBLASLt is loadable."""
    if name in MODE_PATHS:
        return MODE_PATHS[name][bool(fp8)]
    if name in KERNEL_PATHS:
        return name
    raise ValueError(f"precision {name!r}: expected one of {', '.join(CHOICES)}")


@dataclass(frozen=True)
class Plan:
    """What the kernels of the next forward run: the kernel ``path`` (its ``row`` says what each op family does)
    and ``range_safe`` (the fallback run: split operands beyond fp16's range are scaled by a power of two,
    cuda/range.cuh). Hashable: CUDA graphs are kept per plan, since it selects the kernels they capture."""

    path: str
    range_safe: bool = False

    def __post_init__(self):
        if self.path not in TABLE:
            raise ValueError(f"kernel path {self.path!r}: expected one of {', '.join(TABLE)}")

    @property
    def row(self) -> Row:
        return TABLE[self.path]


# the engine's second try after a guard tripped (CudaOps.fallback): split, range-safe, no fp8 twins
RANGE_SAFE = Plan("split", range_safe=True)
