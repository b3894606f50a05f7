"""Precision, in three words: the ``precision`` a user sets (``--precision``, ``load(precision=...)``) names a
*mode* (``fast``, ``exact``; the numpy backend's ``fp32``) or pins a kernel *path* (``fp16``, ``split``,
``split8``); a backend runs a *plan*, its path and whether the range-safe scaling is on. Every precision check of
the kernels and the model code reads a ``Plan``'s properties, never a path's string. A new mode or path starts
here.

* ``fast`` (the default on every GPU): each fp32 activation is rounded once to fp16 for the tensor cores, fp32
  accumulation, fp32 residual stream. A batch whose per-layer guard trips (NaN, Inf, all zero: what fp16's range
  cannot hold) runs again through the range-safe exact path (``Engine.forward``).
* ``exact``: each activation enters as hi + lo fp16 halves (``split``), or, where fp8 tensor cores and cuBLASLt
  exist, hi in fp16 and lo in fp8 against fp8 copies of the weights (``split8``).

The expert names ``fp16``, ``split`` and ``split8`` stay valid and pin that kernel path.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("fast", "exact")
KERNEL_PATHS = ("fp16", "split", "split8")
CHOICES = MODES + KERNEL_PATHS
DEFAULT = "fast"
FP32 = "fp32"     # the numpy backend's one mode and path: fp32 throughout
# What ``clefcore verify`` holds each mode to against the fp32 numpy path: (per-layer relative error of the
# residual stream, probability difference). The probability bar is each mode's contract (fast: 1e-2, several
# times closer than the reference's own bf16 GPU path). fast's residual stream drifts by ~3e-4 per layer (one fp16
# rounding of every GEMM input): 1.02e-2 after clef-flash's 32 layers on the H200, so its layer bar is 3e-2.
VERIFY_BOUND = {"fast": (3e-2, 1e-2), "exact": (2e-3, 2e-3)}


def resolve(name: str, fp8: bool) -> str:
    """A mode or kernel-path name -> the kernel path (fp16, split, split8). ``fp8``: the device has fp8 tensor
    cores (compute capability 8.9+) and cuBLASLt is loadable."""
    if name == "fast":
        return "fp16"
    if name == "exact":
        return "split8" if fp8 else "split"
    if name in KERNEL_PATHS:
        return name
    raise ValueError(f"precision {name!r}: expected one of {', '.join(CHOICES)}")


def mode_of(path: str) -> str:
    """The mode a kernel path belongs to."""
    if path == FP32:
        return FP32
    return "fast" if path == "fp16" else "exact"


@dataclass(frozen=True)
class Plan:
    """What the kernels of the next forward run: the kernel ``path`` and ``range_safe`` (the fallback run: split
    operands beyond fp16's range are scaled by a power of two, cuda/range.cuh). Hashable: CUDA graphs are kept per
    plan, since it selects the kernels they capture."""

    path: str
    range_safe: bool = False

    @property
    def fp16(self) -> bool:
        """Each fp32 activation is rounded once to fp16 for the tensor cores (the fast mode)."""
        return self.path == "fp16"

    @property
    def splits(self) -> bool:
        """Activations enter the GEMMs as hi + lo halves (split, split8)."""
        return self.path in ("split", "split8")

    @property
    def fp8(self) -> bool:
        """The lo halves run in fp8 against fp8 twins of the weights, where a weight has one (split8)."""
        return self.path == "split8"


# the engine's second try after a guard tripped (CudaOps.fallback): split, range-safe, no fp8 twins
RANGE_SAFE = Plan("split", range_safe=True)
