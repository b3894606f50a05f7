"""The CUDA backend's shared state, in named objects: what its op objects (norms, matmul, attention, delta_rule,
head, vision) read and write besides the device context (device.py). The precision plan is
``clefcore.precision.Plan`` (``DeviceContext.plan``, with its row of the precision table); the GEMM choices, split8's
fp8 twins and the memos are here."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...kernel_select import GemmRoute


@dataclass
class GemmChoices:
    """Which GEMM routes ran (``CudaOps.gemm``; ``Matmul.choose``); clefcore/kernel_select.py says which
    may."""

    pin: GemmRoute | None = None     # --gemm: None = auto (timed per shape the first time it is seen)
    chosen: dict = field(default_factory=dict)   # the autotune's shape_key -> its GemmRoute
    seen: dict | None = None     # while a gemm_routes() block runs: shape_key -> the GemmRoute each GEMM took


@dataclass
class Fp8Twins:
    """split8's fp8 copies of the weights (``CudaOps.twins``): ``gemm`` is cuBLASLt's fp8 GEMM (None unless the
    plan's GEMM operands take an fp8 lo half); ``by_ptr`` maps an fp16 weight's device pointer to (weight, fp8
    twin, inverse scale); ``skipped`` counts the matrices left without a twin (they run split); ``warned``: the
    low-memory warning was given."""

    gemm: object | None = None
    by_ptr: dict = field(default_factory=dict)
    skipped: int = 0
    warned: bool = False

    def of(self, w):
        """w's (weight, fp8 twin, inverse scale), or None. The pointer alone is not enough: a view of a weight's
        first rows (the head slices its attention in-projections) starts at the same address."""
        t = self.by_ptr.get(w.data.ptr)
        return t if t is not None and t[0].shape == w.shape and w.flags.c_contiguous else None

    def cover(self, M, *ws) -> bool:
        """Every weight has its fp8 twin and cuBLASLt runs the shape with M rows."""
        return (all(self.of(w) is not None for w in ws)
                and all(self.gemm.supports(M, w.shape[0], w.shape[1]) for w in ws))

    def drop(self, w) -> None:
        """Forget w's twin (bench's throwaway weights)."""
        self.by_ptr.pop(w.data.ptr, None)


@dataclass
class Caches:
    """Memos kept for the life of a ``CudaOps`` (``DeviceContext.caches``): compiled functions by (module, name), the
    dynamic shared memory each was opted into, the attention kernels' launch shape per (file, head dim), and the
    small index tables uploaded by content (``DeviceContext.upload``), with the arena they live in once reserve() made
    one: kept apart from the forwards' arena, where an entry that outlives its forward would pin a hole."""

    functions: dict = field(default_factory=dict)
    smem: dict = field(default_factory=dict)
    attn_launch: dict = field(default_factory=dict)
    uploads: dict = field(default_factory=dict)
    upload_arena: object = None      # clefcore.pool.Arena
