"""Which GPU kernel runs: one pure function per kernel family (GEMM, attention, delta rule, norms and elementwise
producers, head), each from the plain facts of a ``Setting`` (the precision plan's row, the kernel switches in
effect, the device's capabilities) and the op's own shape facts. The CUDA backend (clefcore/backends/cuda/) asks
here and launches what it is told; a new kernel variant, switch or device rule starts here.

Importable without CuPy or a GPU: tests/test_kernel_select.py holds every function to a table of choices over
each plan, switch state and capability.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from .precision import DELTA_FAST, DELTA_ONE_PASS, DeltaRule, Row
from .switches import WY_ONE_PASS, Switch


@dataclass(frozen=True)
class Device:
    """What the choices read of a GPU: compute capability ``cc`` (major, minor), whether the kernels run
    ``native`` code built for it (False: the compute_70 PTX, the Volta code), the dynamic shared memory a block
    may opt into, and whether cuBLAS can be loaded."""

    cc: tuple[int, int]
    native: bool
    smem_optin: int
    cublas: bool


@dataclass(frozen=True)
class Setting:
    """Everything a choice depends on besides the op's shape: the plan's ``row`` (clefcore/precision.py), the
    switches ``on`` (clefcore/switches.py) and the ``device``."""

    row: Row
    on: frozenset[Switch]
    device: Device


def fp8_tensor_cores(device: Device) -> bool:
    """Whether split8 may run here, given a loadable cuBLASLt (asked only then): fp8 tensor cores (8.9+) and
    cuBLAS."""
    return device.cublas and device.cc >= (8, 9)


# ------------------------------------------------------------------------------------------------------ GEMM

class GemmRoute(Enum):
    """A GEMM's route (``CudaOps.gemm_with``): what the autotune times, what ``--gemm`` pins, what
    ``gemm_routes`` records."""

    CUBLAS = "cublas"     # cuBLAS on the fp16 operand (an fp32 activation rounded once)
    SPLIT = "split"       # cuBLAS over split's hi + lo halves
    SPLIT8 = "split8"     # the lo half in fp8 against the weight's fp8 twin (cuBLASLt), hi on cuBLAS
    WMMA = "wmma"         # gemm.cu's WMMA kernels, fp16 or split operands as the row says
    ROWS = "rows"         # gemm_rows.cu: few rows, fp32 products on the CUDA cores
    MMA = "mma"           # gemm_mma.cu (sm_80+; gemm_wgmma.cu on sm_90), fp16 operands

    def __str__(self):
        return self.value


# --gemm's routes besides auto (gpu_settings.GEMM_CHOICES): always candidates, so a pin always runs
GEMM_PINS = (GemmRoute.WMMA, GemmRoute.CUBLAS)
ROWS_MAX_M = 64          # GEMMs of up to this many rows may run gemm_rows.cu (timed against the tile routes)
# gemm_mma.cu's tiles, the larger first: (kernel, block rows, block columns, dynamic shared memory = 3 stages x
# (A + W tile rows) x padded row x 2 bytes). A GPU takes the first whose shared memory it has per block.
MMA_TILES = (("gemm_mma_f16a_big", 256, 128, 3 * (256 + 128) * 72 * 2),
             ("gemm_mma_f16a", 128, 128, 3 * (128 + 128) * 40 * 2))
# The same route on Hopper (sm_90): gemm_wgmma.cu, 1.8-2.0x gemm_mma.cu's big tile on the H100 (0.70-0.89 of
# cuBLAS from 512 rows up; docs/bench/2026-12-05-h100-wgmma-gemm/). Dynamic shared memory = 4 stages x
# (A + W tile rows) x 128-byte rows, + 1024 to align the swizzle atoms.
WGMMA_TILE = ("gemm_wgmma_f16a", 128, 256, 4 * (128 + 256) * 128 + 1024)


def mma_tile(device: Device) -> tuple[str, tuple] | None:
    """The "mma" route's kernel on ``device``: (file, (name, block rows, block columns, shared memory)), or None
    where the route does not run: before sm_80, and on the compute_70 PTX (no mma.sync m16n8k16), or where no
    tile's shared memory fits."""
    if device.cc < (8, 0) or not device.native:
        return None
    if device.cc == (9, 0) and device.smem_optin >= WGMMA_TILE[3]:
        return "gemm_wgmma.cu", WGMMA_TILE
    tile = next((t for t in MMA_TILES if t[3] <= device.smem_optin), None)
    return None if tile is None else ("gemm_mma.cu", tile)


def _mma_runs(s: Setting, K: int) -> bool:
    """The mma route can take a GEMM over K: it runs here, K is a multiple of 8 (its 16-byte copies never
    straddle a row's end) and the row rounds operands once to fp16 (its operands are fp16)."""
    return mma_tile(s.device) is not None and K % 8 == 0 and s.row.gemm.fp16


def gemm_candidates(s: Setting, M: int, K: int, x_fp16: bool) -> tuple[GemmRoute, ...]:
    """The routes the autotune times for out[M, N] = x[M, K] @ w^T, in timing order (ties go to the first):
    wmma; cuBLAS where it loads (``cublas_route`` says which of its routes); gemm_rows.cu for up to ROWS_MAX_M
    rows of an fp32 x; the mma route where it runs and the operand is not split."""
    split = s.row.gemm.split and not x_fp16
    routes = [GemmRoute.WMMA] + ([GemmRoute.CUBLAS] if s.device.cublas else [])
    if M <= ROWS_MAX_M and not x_fp16:
        routes.append(GemmRoute.ROWS)
    if _mma_runs(s, K) and not split:
        routes.append(GemmRoute.MMA)
    return tuple(routes)


def swiglu_candidates(s: Setting, K: int) -> tuple[GemmRoute, ...]:
    """The routes the autotune times for the SwiGLU MLP's gate/up GEMM over K (``CudaOps.mlp``): wmma (SwiGLU in
    its epilogue), cuBLAS(Lt) for all three GEMMs where it loads, the mma route's fused kernel where it runs and
    the row does not split."""
    routes = [GemmRoute.WMMA] + ([GemmRoute.CUBLAS] if s.device.cublas else [])
    if _mma_runs(s, K) and not s.row.gemm.split:
        routes.append(GemmRoute.MMA)
    return tuple(routes)


def cublas_route(s: Setting, x_fp16: bool, twinned: Callable[[], bool]) -> GemmRoute:
    """The cuBLAS candidate's route: an fp16 x, or a row that rounds once, on cuBLAS as fp16; a split row's fp32
    x as split8 where the row takes an fp8 lo half and ``twinned()`` (every weight has its fp8 twin and cuBLASLt
    runs the shape; asked only for a split x, as it may query cuBLASLt), else split."""
    if not s.row.gemm.split or x_fp16:
        return GemmRoute.CUBLAS
    return GemmRoute.SPLIT8 if s.row.gemm.fp8_lo and twinned() else GemmRoute.SPLIT


# ------------------------------------------------------------------------------------------------- attention

@dataclass(frozen=True)
class AttnKernels:
    """One kernel file's attention kernels: ``{prefix}_fwd_d{D}`` (causal), ``{prefix}_bidir_d{D}``
    (bidirectional) and ``{prefix}_launch_d{D}``, which reports the launch shape as compiled for the device."""

    file: str
    prefix: str

    def name(self, kind: str, D: int) -> str:
        return f"{self.prefix}_{kind}_d{D}"


ATTN = AttnKernels("attention.cu", "attn")                 # every GPU; mma.sync on sm_80+, wmma before
ATTN_WGMMA = AttnKernels("attention_wgmma.cu", "attn_wgmma")   # causal, WGMMA_DIMS, sm_90a only
# head dims with a causal kernel in attention_wgmma.cu (sm_90a): attn_wgmma_fwd_d{D}
WGMMA_DIMS = (256,)


def causal_attention(s: Setting, D: int, kv_fp16: bool) -> AttnKernels:
    """The causal attention's kernels: attention_wgmma.cu (Hopper's warpgroup MMAs) on compute capability 9.0
    running native code (the file's body is built for sm_90a only; the compute_70 PTX has an empty kernel), a
    head dim in WGMMA_DIMS and K and V in fp16 (the K/V cache, which the kernel reads as it is); attention.cu
    otherwise. Every plan: the causal attention reads the fp16 cache on each."""
    d = s.device
    if d.native and d.cc == (9, 0) and D in WGMMA_DIMS and kv_fp16:
        return ATTN_WGMMA
    return ATTN


class Products(Enum):
    """How an op's products run where a kernel or plain fp32 arithmetic may: fp16 operands on a kernel's tensor
    cores, fp32 products through cuBLAS, or fp32 products as a reduction over broadcast views (no cuBLAS)."""

    FP16_KERNEL = "fp16 kernel"
    FP32_CUBLAS = "fp32 products, cuBLAS"
    FP32_REDUCTION = "fp32 products, a reduction kernel"


def bidirectional_attention(s: Setting) -> Products:
    """The vision tower's attention: attention.cu's fp16 kernel (q/k/v written in fp16 by the RoPE pass) where
    the row says ``attention_fp16``, else fp32 products (CuPy's matmul: cuBLAS)."""
    return Products.FP16_KERNEL if s.row.attention_fp16 else Products.FP32_CUBLAS


# ------------------------------------------------------------------------------------------------ delta rule

def delta_rule(s: Setting) -> DeltaRule:
    """The Gated DeltaNet kernels: the row's (WY form; fast's file rounds the output's products once), or under the
    wy_one_pass switch, in fast, every product rounded once."""
    if s.row.delta_rule is DELTA_FAST and WY_ONE_PASS in s.on:
        return DELTA_ONE_PASS
    return s.row.delta_rule


# -------------------------------------------------------------------------------- norms and elementwise ops

class Operand(Enum):
    """The dtype a producer writes a GEMM's activation in (``gemm_input``)."""

    FP16 = "float16"
    FP32 = "float32"


def gemm_operand(s: Setting, rows: int) -> Operand:
    """What a norm or gate asked for a GEMM's activation of ``rows`` rows writes: fp16 where the row fuses the
    elementwise producers (the rounding every route but gemm_rows.cu would make), fp32 otherwise and for up to
    ROWS_MAX_M rows, which may take gemm_rows.cu (fp32 products: an fp16 operand would change its result, and a
    cast of so few rows costs nothing)."""
    return Operand.FP16 if s.row.fused_elementwise and rows > ROWS_MAX_M else Operand.FP32


# ------------------------------------------------------------------------------------------------------ head

def head_products(s: Setting) -> Products:
    """The head's fp32 batched products (its attention scores and mix): cuBLAS through clefcore's ctypes entry
    (a CUDA graph accepts it), or where cuBLAS cannot be loaded a reduction over broadcast views."""
    return Products.FP32_CUBLAS if s.device.cublas else Products.FP32_REDUCTION
