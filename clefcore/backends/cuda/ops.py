"""``CudaOps``: the ``Backend`` (clefcore/backends/interface.py) on an NVIDIA GPU (CuPy + RawKernels).

Same names, shapes and semantics as the fp32 numpy reference. Activations are fp32 device arrays; matrix
weights are fp16 (exact conversions of the bf16 checkpoint values, counted when they do not fit); vectors
(norm weights, biases, conv taps, A_log, dt_bias, scalars) stay fp32; the GDN state and every softmax
statistic are fp32. GEMMs take fp16 operands with fp32 accumulation, either through the WMMA kernel of
``cuda/gemm.cu`` or through cuBLAS (``cublasGemmEx``, fp16 in, fp32 out, fp32 compute) as CuPy exposes it,
chosen per (N, K, M-bucket) by a short timed trial the first time a shape is seen (logged).
The vocabulary tables stay in host memory by default (``tables="host"``): only the rows a request needs
are gathered there and copied.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager

import numpy as np

from ... import errors, gpu_settings, kernel_select, switches
from ... import precision as precision_modes
from ...kernel_select import GemmRoute
from ...precision import RANGE_SAFE, Plan
from . import cublas
from .attention import AttentionOps
from .compile import load_module
from .delta_rule import DeltaRuleOps
from .elementwise import ELEM_THREADS, sigmoid_k, silu_k
from .graphs import GraphCache
from .head import HeadOps
from .matmul import MatmulOps
from .norms import NormOps
from .state import Caches, Fp8Twins, GemmChoices
from .vision import VisionOps

log = logging.getLogger("clefcore.cuda")

# the joint-head graphs kept, one per question schema and bucket of the stream's length (a graph's pool at 1,024
# tokens: a few tens of MB, its inputs' copies and the head's activations)
HEAD_GRAPHS = 8


def row_map(shape, strides, itemsize):
    """How a kernel walks x [..., D] (its shape and byte strides) as R rows of D in place: row r starts
    (r // heads) * rs + (r % heads) * hs elements in. (rs, 1, 0) when every leading axis collapses onto one row
    stride; (token stride, H, head stride) for a [T, H, D] view whose rows do not (the q columns of the conv
    output viewed per head); None when neither fits (the caller copies)."""
    if not shape:
        return None
    D = shape[-1]
    if strides[-1] != itemsize and D != 1:
        return None
    stride, expect, uniform = None, None, True
    for n, s in reversed(list(zip(shape[:-1], strides[:-1]))):   # leading axes, innermost first
        if n == 1:
            continue
        if expect is None:
            stride = s
        elif s != expect:
            uniform = False
            break
        expect = s * n
    if uniform:
        rs = (stride if stride is not None else D * itemsize) // itemsize
        if (stride is None or stride % itemsize == 0) and rs >= D:
            return rs, 1, 0
    if (len(shape) == 3 and strides[-1] == itemsize and strides[0] % itemsize == 0 and strides[1] % itemsize == 0
            and strides[1] >= D * itemsize and strides[0] > 0):
        return strides[0] // itemsize, shape[1], strides[1] // itemsize
    return None


class HostTable:
    """A vocabulary table left in host memory: bf16 bits (uint16) or fp32, gathered row by row."""

    def __init__(self, ref):
        self.raw = ref.raw
        self.dtype = ref.dtype
        self.shape = tuple(ref.shape)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(self.raw[ids])


class DeviceTable:
    """A vocabulary table copied to the device as bf16 bits (2 bytes a value)."""

    def __init__(self, bits, shape):
        self.bits = bits
        self.shape = tuple(shape)


class CudaOps(NormOps, MatmulOps, AttentionOps, DeltaRuleOps, HeadOps, VisionOps):
    """The ``Backend`` on one GPU. This class holds the device, the weights and tables, the plumbing every op
    uses, the guards and the forward hooks; the ops themselves come by concern from the mixins (norms.py,
    matmul.py, attention.py, delta_rule.py, head.py, vision.py). What they share beyond the device is in a few
    named objects: ``plan`` (the precision plan), ``gemm`` (the GEMM choices), ``twins`` (split8's fp8 weights)
    and ``caches`` (state.py)."""

    name = "cuda"
    falls_back = True
    # the Backend's data members, set in __init__
    xp: object
    mode: str
    plan: Plan
    token_block: int
    graphs: GraphCache
    tower_graphs: GraphCache
    head_graphs: GraphCache

    def __init__(self, device_id: int = 0, max_tokens: int = 32768, gemm: str = gpu_settings.GEMM_DEFAULT,
                 tables: str = "host", ptx70: bool = False, token_block: int = gpu_settings.TOKEN_BLOCK,
                 gdn_block_chunks: int = 128, precision: str = precision_modes.DEFAULT,
                 graph_tokens: int = gpu_settings.GRAPH_TOKENS, graphs: int = 4,
                 kernels: str | None = None):
        import cupy
        self.cp = cupy
        self.xp = cupy
        self.device_id = int(device_id)
        self.device = cupy.cuda.Device(self.device_id)
        self.device.use()
        self.max_tokens = int(max_tokens)
        pin = gpu_settings.gemm_pin(gemm)
        if precision not in precision_modes.CHOICES:
            raise ValueError(f"precision must be one of {', '.join(precision_modes.CHOICES)}")
        props = cupy.cuda.runtime.getDeviceProperties(self.device_id)
        self.device_name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.cc = (props["major"], props["minor"])
        self.max_smem_optin = int(props.get("sharedMemPerBlockOptin", 49152))
        self.sm_count = int(props["multiProcessorCount"])
        # Without a loadable cuBLAS (an image that leaves the CUDA math libraries out) every matmul runs
        # clefcore's own kernels; said once here, and shown by the server's /health and /metrics.
        self.cublas_missing = cublas.missing()
        if self.cublas_missing is not None:
            if pin is GemmRoute.CUBLAS:
                raise errors.DeviceError(f"gemm cublas: cuBLAS cannot be loaded ({self.cublas_missing})")
            log.warning("cuBLAS cannot be loaded (%s): every GEMM runs clefcore's own kernels", self.cublas_missing)
        self.gemm = GemmChoices(pin)
        self.ptx70 = bool(ptx70)
        fp8 = False
        if kernel_select.fp8_tensor_cores(self.caps):
            from . import cublaslt
            fp8 = cublaslt.available()
        # The kernel path and what each op family runs on it: a row of clefcore/precision.py's table (fp16 = one
        # rounding of each activation, fast; split = hi + lo fp16 halves, fp32-grade products with the fp16-exact
        # weights; split8 = the lo pass in fp8 against an fp8 twin of each weight, sm_89+, ~1.5 passes' time).
        # ``fallback`` switches the plan to the range-safe one.
        self.plan = Plan(precision_modes.resolve(precision, fp8))
        if self.plan.row.gemm.fp8_lo and not fp8:
            raise errors.DeviceError(f"precision {self.plan.path} needs fp8 tensor cores (compute capability 8.9 "
                                     f"or newer) and cuBLASLt; {self.device_name} is {self.cc[0]}.{self.cc[1]}"
                                     + ("" if self.cublas_missing is None else ", without cuBLAS"))
        self.mode = self.plan.row.mode
        self.twins = Fp8Twins()
        if self.plan.row.gemm.fp8_lo:
            from . import cublaslt
            self.twins.gemm = cublaslt.Fp8Gemm(cupy)
        # the kernel switches in effect (clefcore/switches.py): the kernels option, else the environment
        self.switches = switches.resolve(kernels)
        if self.switches:
            log.info("kernel switches on: %s", ", ".join(sorted(s.name for s in self.switches)))
        self.tables = tables
        # model.backbone runs every layer over blocks of token_block tokens (layer-outer, block-inner), so the
        # activations beyond the residual stream and the K/V cache are [token_block, *]; 0 = whole stream
        self.token_block = int(token_block)
        self.gdn_block_chunks = int(gdn_block_chunks)
        self.arena = None            # clefcore.pool.Arena, once reserve() has sized it
        self.fp16_overflow = 0       # weight values saturated to +-65504
        self.fp16_underflow = 0      # nonzero weight values that became 0 in fp16
        self._counts = cupy.zeros(2, dtype=cupy.uint64)
        self.caches = Caches()
        self._pinned = None          # during a graph capture: the uploads the graph reads (graphs.py)
        self._staged = []            # pinned host buffers of asynchronous uploads still in flight
        self._watched = []
        # single-sequence prompts up to graph_tokens replay a CUDA graph (0 = never)
        self.graphs = GraphCache(self, graph_tokens, graphs)
        # the vision tower's graphs (fast mode, per set of image sizes) in a cache of their own, so that the image
        # sizes a service sees never evict the short prompts' graphs
        self.tower_graphs = GraphCache(self, graph_tokens, 2)
        # the joint head's graphs, one per question schema and bucket of the stream's length (model/head.py)
        self.head_graphs = GraphCache(self, graph_tokens, HEAD_GRAPHS)

    # ------------------------------------------------------------------------------------------ plumbing
    @property
    def caps(self) -> kernel_select.Device:
        """What the kernel choices read of this GPU (clefcore/kernel_select.py)."""
        return kernel_select.Device(self.cc, not self.ptx70, self.max_smem_optin, self.cublas_missing is None)

    @property
    def setting(self) -> kernel_select.Setting:
        """What every kernel choice reads: the plan's row now (``fallback`` switches it), the switches, the GPU."""
        return kernel_select.Setting(self.plan.row, self.switches, self.caps)

    def kernel(self, module: str, name: str, smem: int = 0):
        key = (module, name)
        fn = self.caches.functions.get(key)
        if fn is None:
            fn = load_module(module, self.ptx70).get_function(name)
            self.caches.functions[key] = fn
        if smem > 49152 and self.caches.smem.get(key, 0) < smem:
            if smem > self.max_smem_optin:
                raise errors.DeviceError(f"{name} needs {smem} bytes of shared memory; the device allows "
                                         f"{self.max_smem_optin}")
            fn.max_dynamic_shared_size_bytes = smem
            self.caches.smem[key] = smem
        return fn

    def _grid1(self, n):
        return (int(min(max(1, -(-n // ELEM_THREADS)), 65535 * 8)),)

    def _f32(self, x):
        cp = self.cp
        x = cp.asarray(x)
        if x.dtype != cp.float32:
            x = x.astype(cp.float32)
        return x

    def _c(self, x):
        """fp32, C-contiguous, 16-byte aligned."""
        x = self._f32(x)
        if not x.flags.c_contiguous or x.data.ptr % 16:
            x = self.cp.ascontiguousarray(x)
            if x.data.ptr % 16:
                x = x.copy()
        return x

    def _row_map(self, x):
        """x [..., D] as R rows of D read in place where ``row_map`` allows, else a contiguous copy.
        -> (x, R, D, rs, heads, hs)"""
        x = self._f32(x)
        D = x.shape[-1]
        R = int(np.prod(x.shape[:-1], dtype=np.int64)) if x.ndim > 1 else 1
        m = row_map(x.shape, x.strides, x.itemsize)
        if m is None:
            x = self.cp.ascontiguousarray(x)
            m = (D, 1, 0)
        return (x, R, D) + m

    @staticmethod
    def _map_args(rs, heads, hs):
        """norms.cu's row map arguments (xs, xh, xhs) for _row_map's (rs, heads, hs)."""
        return np.int64(rs), np.int32(heads), np.int64(hs)

    def _rows(self, x):
        """View x [..., D] as R rows of D with one uniform row stride (elements); copies if it cannot."""
        x, R, D, rs, heads, _ = self._row_map(x)
        if heads > 1:
            x = self.cp.ascontiguousarray(x)
            rs = D
        return x, R, D, rs

    def _upload(self, a: np.ndarray):
        """A small host index table (tiles, chunks, row starts) on the device, memoised by content: every layer
        of a forward asks for the same tables. During a graph capture a table must already be here (a copy
        recorded into the graph would re-read a staging buffer that is gone by then): the capture fails and
        that prompt runs eagerly."""
        a = np.ascontiguousarray(a)
        key = (a.dtype.str, a.shape, a.tobytes())
        uploads = self.caches.uploads
        d = uploads.get(key)
        if d is None:
            if self._pinned is not None:
                raise errors.DeviceError("index table upload during a CUDA graph capture")
            arena = self.caches.upload_arena
            if len(uploads) >= 256 or (arena is not None and arena.free.largest_free() < a.nbytes):
                uploads.clear()      # tables a CUDA graph reads stay alive with it
            if arena is None:
                d = self._to_device(a)
            else:
                with self.cp.cuda.using_allocator(arena.malloc):
                    d = self._to_device(a)
            uploads[key] = d
        if self._pinned is not None:
            self._pinned.append(d)
        return d

    def _to_device(self, a: np.ndarray):
        """Host -> device without waiting for the GPU: a copy from pageable memory first drains the stream, which
        would stop the host from queueing the head while the backbone runs. The data is staged in pinned memory
        and copied asynchronously on the current stream; the staging buffers are kept until the next host read
        (``to_host``, ``check_watched``), by which point the stream has passed their copies."""
        cp = self.cp
        a = np.ascontiguousarray(a)
        if self._pinned is not None:
            # a copy recorded into a graph would re-read a staging buffer that is gone by its replay
            raise errors.DeviceError(f"host upload of {a.shape} {a.dtype} during a CUDA graph capture")
        if a.size == 0:
            return cp.asarray(a)
        import cupyx
        staged = cupyx.empty_pinned(a.shape, a.dtype)
        staged[...] = a
        d = cp.empty(a.shape, a.dtype)
        d.set(staged, stream=cp.cuda.get_current_stream())
        self._staged.append(staged)
        return d

    def empty(self, shape, dtype=np.float32):
        return self.cp.empty(shape, dtype=dtype)

    # ------------------------------------------------------------------------------ interface basics
    def asarray(self, x):
        return self._to_device(x) if isinstance(x, np.ndarray) else self.cp.asarray(x)

    def to_host(self, x) -> np.ndarray:
        if not isinstance(x, self.cp.ndarray):
            return np.asarray(x)
        out = self.cp.asnumpy(x)              # waits for the stream: every staged upload before it is done
        self._staged.clear()
        return out

    def weight(self, w):
        """A checkpoint tensor (TensorRef, or an fp32 host array) for this backend: matrices (both dims >= 16)
        -> fp16, converted on the device and counted (a bf16 matrix travels as its 2-byte bits and is never
        widened on the host); the rest fp32."""
        from ...checkpoint import TensorRef, to_float32
        cp = self.cp
        if isinstance(w, TensorRef):
            if w.dtype == "BF16" and len(w.shape) == 2 and min(w.shape) >= 16:
                return self.twin(self._to_half_counted(cp.asarray(np.ascontiguousarray(w.raw)), "bf16_to_half_count"))
            w = to_float32(w)
        w = np.ascontiguousarray(w, dtype=np.float32)
        if w.ndim == 2 and min(w.shape) >= 16:
            return self.twin(self._to_half_counted(cp.asarray(w), "f32_to_half_count"))
        return cp.asarray(w)

    def twin(self, w16):
        """split8: give an fp16 weight matrix its fp8 twin (scaled by a power of two so its largest magnitude
        lands at most at 448) and return the weight. Skipped (the matrix then runs split) where cuBLASLt's fp8
        alignment rules do not hold (16-byte rows: K a multiple of 16, N of 4 for the fp32 output) or the twin
        would leave under 2 GiB free."""
        twins = self.twins
        if twins.gemm is None:
            return w16
        cp = self.cp
        N, K = w16.shape
        if N % 4 or K % 16:
            twins.skipped += 1
            return w16
        free = cp.cuda.runtime.memGetInfo()[0]
        if free < w16.size + (2 << 30):
            if not twins.warned:
                log.warning("split8: %.2f GiB free on the device; the fp8 copy of a [%d, %d] weight (and of any "
                            "later one that does not fit) is left out, those matrices run split", free / 2 ** 30,
                            N, K)
                twins.warned = True
            twins.skipped += 1
            return w16
        amax = float(cp.abs(w16).max())
        s = 2.0 ** math.floor(math.log2(448.0 / amax)) if amax > 0 else 1.0
        w8 = cp.empty((N, K), dtype=cp.uint8)
        self.kernel("fp8.cu", "half_to_e4m3")(self._grid1(w16.size), (ELEM_THREADS,),
                                              (w16, w8, np.int64(w16.size), np.float32(s)))
        twins.by_ptr[w16.data.ptr] = (w16, w8, cp.asarray(np.array([1.0 / s], np.float32)))
        return w16

    def _to_half_counted(self, src, kernel: str):
        out = self.cp.empty(src.shape, dtype=self.cp.float16)
        self._counts.fill(0)
        self.kernel("gemm.cu", kernel)(self._grid1(src.size), (ELEM_THREADS,), (src, out, np.int64(src.size),
                                                                                 self._counts))
        over, under = (int(v) for v in self._counts.get())
        if over or under:      # per tensor at debug level: the load ends with one summary (fp16_summary)
            log.debug("fp16 weight conversion: %d values saturated to +-65504, %d flushed to zero (tensor %s)",
                      over, under, src.shape)
        self.fp16_overflow += over
        self.fp16_underflow += under
        return out

    def fp16_summary(self) -> str | None:
        """One line for the end of a load when any weight did not fit fp16, else None."""
        if not (self.fp16_overflow or self.fp16_underflow):
            return None
        return (f"fp16 weights: {self.fp16_overflow} values beyond +-65504 were saturated, {self.fp16_underflow} "
                f"nonzero values below 2^-24 became 0")

    def table(self, ref):
        if self.tables == "device":
            cp = self.cp
            if ref.dtype == "BF16":
                return DeviceTable(cp.asarray(np.ascontiguousarray(ref.raw)), ref.shape)
            from ...checkpoint import bf16_bits, to_float32
            return DeviceTable(cp.asarray(bf16_bits(to_float32(ref))), ref.shape)
        return HostTable(ref)

    def _widen_rows(self, table, ids):
        cp = self.cp
        ids_h = np.asarray(self.to_host(ids), dtype=np.int64).reshape(-1)
        D = table.shape[1]
        out = cp.empty((ids_h.size, D), dtype=cp.float32)
        if ids_h.size == 0:
            return out
        if isinstance(table, DeviceTable):
            dids = self._to_device(ids_h)
            self.kernel("embed.cu", "gather_bf16_rows")(self._grid1(out.size), (ELEM_THREADS,),
                                                        (table.bits, dids, out, np.int32(ids_h.size), np.int32(D)))
            return out
        rows = table.rows(ids_h)
        if table.dtype == "BF16":
            dev = self._to_device(rows)
            self.kernel("embed.cu", "widen_bf16")(self._grid1(out.size), (ELEM_THREADS,),
                                                  (dev, out, np.int64(out.size)))
            return out
        return self._to_device(rows.astype(np.float32))

    def gather_rows(self, table, ids):
        if isinstance(table, (HostTable, DeviceTable)):
            return self._widen_rows(table, ids)
        return self._f32(table)[self.asarray(ids)]

    def embed(self, table, ids):
        return self.gather_rows(table, ids)

    def sigmoid(self, x):
        return sigmoid_k()(self._f32(x))

    def silu(self, x):
        return silu_k()(self._f32(x))

    # ------------------------------------------------------------------------------------- guards
    def _finite_flags(self, x, flags):
        x = self._c(x)
        # a grid-stride loop over at most 1024 blocks: few atomics, and enough blocks to fill the GPU
        grid = (int(min(max(1, -(-x.size // ELEM_THREADS)), 1024)),)
        self.kernel("embed.cu", "finite_check")(grid, (ELEM_THREADS,), (x, np.int64(x.size), flags))
        return x.size

    def _raise_if_bad(self, what, size, bad, nz):
        if bad:
            raise errors.GuardError(f"{what}: {bad} of {size} values are NaN or Inf on {self.device_name}", what)
        if size and nz == 0:
            raise errors.GuardError(f"{what}: all {size} values are zero on {self.device_name}", what)

    def check_finite(self, x, what: str = "output"):
        """Raise DeviceError when x holds NaN/Inf or is entirely zero (a silently dead kernel)."""
        flags = self.cp.zeros(2, dtype=self.cp.uint64)
        size = self._finite_flags(x, flags)
        self._raise_if_bad(what, size, *(int(v) for v in flags.get()))

    def watch(self, x, what: str):
        """check_finite without waiting: the flags are read once, by check_watched() at the end of the forward."""
        flags = self.cp.zeros(2, dtype=self.cp.uint64)
        self._watched.append((what, self._finite_flags(x, flags), flags))

    def check_watched(self):
        watched, self._watched = self._watched, []
        if watched:
            counts = self.cp.stack([f for _, _, f in watched]).get()
            self._staged.clear()
            for (what, size, _), (bad, nz) in zip(watched, counts):
                self._raise_if_bad(what, size, int(bad), int(nz))

    def memory_in_use(self) -> int:
        """Device bytes held by live arrays (weights included), the CUDA graphs' private pools and the arena's
        whole reservation (the server's device-memory gauge)."""
        graphs = [g for g in (self.graphs, self.tower_graphs, self.head_graphs) if g is not None]
        used = int(self.cp.get_default_memory_pool().used_bytes()) + sum(g.nbytes() for g in graphs)
        return used + sum(int(a.capacity) for a in _arenas(self))

    def status(self) -> dict:
        """For /health and /metrics: whether cuBLAS is loaded, and why not where it is not (every GEMM then runs
        clefcore's own kernels); the bytes reserve() holds and how many allocations went beyond them."""
        arenas = _arenas(self)
        info: dict = {"cublas": self.cublas_missing is None,
                      "reserved_bytes": sum(int(a.capacity) for a in arenas),
                      "reserve_overflows": sum(int(a.overflows) for a in arenas)}
        if self.cublas_missing is not None:
            info["cublas_missing"] = str(self.cublas_missing)
        return info

    @contextmanager
    def fallback(self):
        """Run the enclosed forward on the range-safe exact path: split (no fp8 twins), with every split operand
        beyond fp16's range scaled by a power of two (range.cuh). In range, the result is split's bit for bit. The
        engine runs a batch here again when its guards tripped in the configured path."""
        saved, self.plan = self.plan, RANGE_SAFE
        try:
            yield
        finally:
            self.plan = saved

    def reserve(self, worst_case) -> int:
        """Size the arena by running ``worst_case`` in it (reserve.py); from then on every forward's buffers come
        from it. Returns the bytes reserved: that arena and the memoised index tables' own."""
        from .reserve import reserve
        reserve(self, worst_case)
        return sum(int(a.capacity) for a in _arenas(self))

    def begin_forward(self):
        """Engine hook: every array made until end_forward() comes from the arena, where reserve() made one, so
        a forward never calls cudaMalloc. Drops guard records a failed forward may have left unread."""
        self._watched = []
        if self.arena is not None:
            self.arena.activate()

    def end_forward(self):
        if self.arena is not None:
            self.arena.deactivate()

    def synchronize(self):
        self.cp.cuda.Device(self.device_id).synchronize()


def _arenas(ops) -> list:
    """The arenas reserve() made: the forwards' and the memoised index tables'."""
    return [a for a in (ops.arena, ops.caches.upload_arena) if a is not None]
