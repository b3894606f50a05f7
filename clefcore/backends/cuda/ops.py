"""``CudaOps``: the op interface of ``clefcore.backends.cpu`` on an NVIDIA GPU (CuPy + RawKernels).

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

from ... import errors
from ... import precision as precision_modes
from ..cpu import ATTN_QUERY_BLOCK, GDN_CHUNK  # noqa: F401  (same constants as the reference)
from ..cpu import check_groups, group_keys
from ..cpu import rope_tables as _rope_tables_host
from . import cublas
from .compile import load_module
from .graphs import GraphCache

log = logging.getLogger("clefcore.cuda")

_ELEM_THREADS = 256
_NULL = np.uint64(0)     # a NULL device pointer passed by value
_ROWS_MAX_M = 64         # GEMMs of up to this many rows may run gemm_rows.cu (autotuned against the tile paths)
_CONV_KMAX, _CONV_TT = 8, 16   # conv1d.cu: CONV_KMAX taps at most, CONV_TT tokens per thread


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


def attention_tiles(cu, t0: int, t1: int, rows: int) -> np.ndarray:
    """attention.cu's work list for query rows [t0, t1) of a packed stream (sequence starts ``cu``): int32 rows
    (seq_start, seq_end, q0, q1), one per ``rows`` queries of a sequence. seq_end is clipped to t1: K/V cache rows
    past the block are not written yet for this layer. Longest causal range (q1 - seq_start) first: the kernel's
    grid runs heads fastest over this order, so the longest blocks of every head start in the first wave."""
    tiles = []
    for s0, s1 in zip(cu[:-1], cu[1:]):
        a, e = max(int(s0), t0), min(int(s1), t1)
        for q0 in range(a, e, rows):
            tiles.append((int(s0), e, q0, min(q0 + rows, e)))
    tiles.sort(key=lambda t: t[0] - t[3])
    return np.array(tiles, dtype=np.int32).reshape(-1, 4)


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


class CudaOps:
    name = "cuda"

    def __init__(self, device_id: int = 0, max_tokens: int = 32768, gemm: str = "auto", tables: str = "host",
                 ptx70: bool = False, token_block: int = 4096, gdn_block_chunks: int = 128, pool=None,
                 precision: str = precision_modes.DEFAULT, graph_tokens: int = 1024, graphs: int = 4):
        import cupy
        self.cp = cupy
        self.xp = cupy
        self.device_id = int(device_id)
        self.device = cupy.cuda.Device(self.device_id)
        self.device.use()
        self.max_tokens = int(max_tokens)
        if gemm not in ("auto", "wmma", "cublas"):
            raise ValueError("gemm must be auto, wmma or cublas")
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
            if gemm == "cublas":
                raise errors.DeviceError(f"gemm cublas: cuBLAS cannot be loaded ({self.cublas_missing})")
            log.warning("cuBLAS cannot be loaded (%s): every GEMM runs clefcore's own kernels", self.cublas_missing)
        self.gemm_mode = gemm
        self._fp8 = None
        fp8 = False
        if self.cublas_missing is None and self.cc >= (8, 9):
            from . import cublaslt
            fp8 = cublaslt.available()
        if precision == "split8" and not fp8:
            raise errors.DeviceError(f"precision split8 needs fp8 tensor cores (compute capability 8.9 or newer) "
                                     f"and cuBLASLt; {self.device_name} is {self.cc[0]}.{self.cc[1]}"
                                     + ("" if self.cublas_missing is None else ", without cuBLAS"))
        # The kernel path (clefcore/precision.py): fp16 = one rounding of each activation (fast); split = hi + lo
        # fp16 halves, fp32-grade products with the fp16-exact weights; split8 = the lo pass in fp8 against an fp8
        # twin of each weight (sm_89+, ~1.5 passes' time).
        self.precision = precision_modes.resolve(precision, fp8)
        self.mode = precision_modes.mode_of(self.precision)
        # range_safe: the fallback run (``fallback``): split operands beyond fp16's range are scaled (range.cuh)
        self.range_safe = False
        self.fallbacks = 0
        if self.precision == "split8":
            from . import cublaslt
            self._fp8 = cublaslt.Fp8Gemm(cupy)
        self.tables = tables
        self.ptx70 = bool(ptx70)
        # model.backbone runs every layer over blocks of token_block tokens (layer-outer, block-inner), so the
        # activations beyond the residual stream and the K/V cache are [token_block, *]; 0 = whole stream
        self.token_block = int(token_block)
        self.gdn_block_chunks = int(gdn_block_chunks)
        self.pool = pool
        self.gemm_choice: dict[tuple, str] = {}
        self.fp16_overflow = 0       # weight values saturated to +-65504
        self.fp16_underflow = 0      # nonzero weight values that became 0 in fp16
        self._counts = cupy.zeros(2, dtype=cupy.uint64)
        self._twins = {}             # split8: fp16 weight pointer -> (weight, fp8 twin, inverse scale)
        self.twins_skipped = 0       # matrices left without a twin (shape or memory): they run split
        self._short_warned = False
        self._fn = {}
        self._smem_set = {}
        self._attn_launch = {}
        self._uploads = {}
        self._pinned = None          # during a graph capture: the uploads the graph reads (graphs.py)
        self._staged = []            # pinned host buffers of asynchronous uploads still in flight
        self._watched = []
        # single-sequence prompts up to graph_tokens replay a CUDA graph (0 = never); the arena opts out
        self.graphs = GraphCache(self, graph_tokens if pool is None else 0, graphs)

    # ------------------------------------------------------------------------------------------ plumbing
    def kernel(self, module: str, name: str, smem: int = 0):
        key = (module, name)
        fn = self._fn.get(key)
        if fn is None:
            fn = load_module(module, self.ptx70).get_function(name)
            self._fn[key] = fn
        if smem > 49152 and self._smem_set.get(key, 0) < smem:
            if smem > self.max_smem_optin:
                raise errors.DeviceError(f"{name} needs {smem} bytes of shared memory; the device allows "
                                         f"{self.max_smem_optin}")
            fn.max_dynamic_shared_size_bytes = smem
            self._smem_set[key] = smem
        return fn

    def _grid1(self, n):
        return (int(min(max(1, -(-n // _ELEM_THREADS)), 65535 * 8)),)

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
        d = self._uploads.get(key)
        if d is None:
            if self._pinned is not None:
                raise errors.DeviceError("index table upload during a CUDA graph capture")
            if len(self._uploads) >= 256:
                self._uploads.clear()
            d = self._uploads[key] = self._to_device(a)
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
        if self._fp8 is None:
            return w16
        cp = self.cp
        N, K = w16.shape
        if N % 4 or K % 16:
            self.twins_skipped += 1
            return w16
        free = cp.cuda.runtime.memGetInfo()[0]
        if free < w16.size + (2 << 30):
            if not self._short_warned:
                log.warning("split8: %.2f GiB free on the device; the fp8 copy of a [%d, %d] weight (and of any "
                            "later one that does not fit) is left out, those matrices run split", free / 2 ** 30,
                            N, K)
                self._short_warned = True
            self.twins_skipped += 1
            return w16
        amax = float(cp.abs(w16).max())
        s = 2.0 ** math.floor(math.log2(448.0 / amax)) if amax > 0 else 1.0
        w8 = cp.empty((N, K), dtype=cp.uint8)
        self.kernel("fp8.cu", "half_to_e4m3")(self._grid1(w16.size), (_ELEM_THREADS,),
                                              (w16, w8, np.int64(w16.size), np.float32(s)))
        self._twins[w16.data.ptr] = (w16, w8, cp.asarray(np.array([1.0 / s], np.float32)))
        return w16

    def _to_half_counted(self, src, kernel: str):
        out = self.cp.empty(src.shape, dtype=self.cp.float16)
        self._counts.fill(0)
        self.kernel("gemm.cu", kernel)(self._grid1(src.size), (_ELEM_THREADS,), (src, out, np.int64(src.size),
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
            self.kernel("embed.cu", "gather_bf16_rows")(self._grid1(out.size), (_ELEM_THREADS,),
                                                        (table.bits, dids, out, np.int32(ids_h.size), np.int32(D)))
            return out
        rows = table.rows(ids_h)
        if table.dtype == "BF16":
            dev = self._to_device(rows)
            self.kernel("embed.cu", "widen_bf16")(self._grid1(out.size), (_ELEM_THREADS,),
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
        return _sigmoid_k()(self._f32(x))

    def silu(self, x):
        return _silu_k()(self._f32(x))

    # -------------------------------------------------------------------------------------- norms
    def _row_launch(self, R, D):
        """norms.cu launch for R rows of D: (grid, block, G threads per row). A block per row from 1024 values
        on (a warp per 4096-wide row left the GPU a quarter occupied at 2048 rows); a warp per narrower row."""
        if D >= 1024:
            return (max(1, R),), (256,), np.int32(256)
        return (max(1, -(-R // 8)),), (256,), np.int32(32)

    def rmsnorm(self, x, w, eps):
        x, R, D, *rmap = self._row_map(x)
        y = self.cp.empty(tuple(x.shape), dtype=self.cp.float32)
        g, b, G = self._row_launch(R, D)
        self.kernel("norms.cu", "rmsnorm_rows")(g, b, (x, *self._map_args(*rmap), self._c(w), y, np.int32(R),
                                                       np.int32(D), G, np.float32(eps)))
        return y

    def add_rmsnorm(self, x, delta, w, eps):
        x, d = self._c(x), self._c(delta)
        D = x.shape[-1]
        R = x.size // D
        s = self.cp.empty(x.shape, dtype=self.cp.float32)
        y = self.cp.empty(x.shape, dtype=self.cp.float32)
        g, b, G = self._row_launch(R, D)
        self.kernel("norms.cu", "add_rmsnorm_rows")(g, b, (x, d, self._c(w), s, y, np.int32(R), np.int32(D), G,
                                                           np.float32(eps)))
        return s, y

    def gated_rmsnorm(self, x, z, w, eps):
        """x, z [..., heads, d]; both read through a row map (z is a per-head view of a wider projection)."""
        shape = x.shape
        x, R, D, *rmap = self._row_map(x)
        z, Rz, Dz, *zmap = self._row_map(z)
        if (Rz, Dz) != (R, D):
            raise ValueError(f"gated_rmsnorm: z {z.shape} does not match x {shape}")
        y = self.cp.empty((R, D), dtype=self.cp.float32)
        g, b, G = self._row_launch(R, D)
        self.kernel("norms.cu", "gated_rmsnorm_rows")(g, b, (x, *self._map_args(*rmap), z, *self._map_args(*zmap),
                                                             self._c(w), y, np.int32(R), np.int32(D), G,
                                                             np.float32(eps)))
        return y.reshape(shape)

    def layernorm(self, x, w, b, eps=1e-5):
        x, R, D, *rmap = self._row_map(x)
        y = self.cp.empty(tuple(x.shape), dtype=self.cp.float32)
        g, bl, G = self._row_launch(R, D)
        self.kernel("norms.cu", "layernorm_rows")(g, bl, (x, *self._map_args(*rmap), self._c(w), self._c(b), y,
                                                          np.int32(R), np.int32(D), G, np.float32(eps)))
        return y

    def l2norm(self, x, eps, scale=1.0):
        x, R, D, *rmap = self._row_map(x)
        y = self.cp.empty(tuple(x.shape), dtype=self.cp.float32)
        g, b, G = self._row_launch(R, D)
        self.kernel("norms.cu", "l2norm_rows")(g, b, (x, *self._map_args(*rmap), y, np.int32(R), np.int32(D), G,
                                                      np.float32(eps), np.float32(scale)))
        return y

    # --------------------------------------------------------------------------------------- GEMM
    def _half(self, x):
        """fp16, C-contiguous, 16-byte aligned; an fp16 array already so is returned as it is."""
        cp = self.cp
        if isinstance(x, cp.ndarray) and x.dtype == cp.float16 and x.flags.c_contiguous and x.data.ptr % 16 == 0:
            return x
        x = self._c(x)
        y = cp.empty(x.shape, dtype=cp.float16)
        self.kernel("gemm.cu", "to_half")(self._grid1(x.size), (_ELEM_THREADS,), (x, y, np.int64(x.size)))
        return y

    def _cublas(self, a16, w16, out, accumulate=False):
        """out[M, N] fp32 (+)= a16[M, K] @ w16[N, K]^T through cublasGemmEx (fp32 compute), current stream."""
        M, K = a16.shape
        cublas.gemm(self.device.cublas_handle, a16.data.ptr, w16.data.ptr, out.data.ptr, M, w16.shape[0], K,
                    self.cp.cuda.get_current_stream().ptr, accumulate)
        return out

    def _range_amax(self, x):
        """The range-safe fallback's max |x| (fp32 bits, on the device) for range.cuh's scaling; NULL otherwise."""
        if not self.range_safe:
            return _NULL
        amax = self.cp.zeros(1, dtype=self.cp.uint32)
        self.kernel("gemm.cu", "abs_amax")(self._amax_grid(x.size), (_ELEM_THREADS,), (x, np.int64(x.size), amax))
        return amax

    def _split(self, x):
        """x fp32 [M, K] -> (fp16 [2, M, K]: hi = fp16(x) over lo = fp16(x - hi), amax): in the range-safe fallback
        x is first scaled by a power of two when it exceeds fp16's range (amax says by how much)."""
        x = self._c(x)
        amax = self._range_amax(x)
        hl = self.cp.empty((2,) + x.shape, dtype=self.cp.float16)
        self.kernel("gemm.cu", "to_half_split")(self._grid1(x.size), (_ELEM_THREADS,),
                                                (x, hl[0], hl[1], np.int64(x.size), amax))
        return hl, amax

    def _split_gemm(self, split, w, out):
        """out[M, N] fp32 = (hi + lo) @ w^T for split = _split(x): two cuBLAS passes, the second accumulating, then
        the range scaling undone. (One pass over hi stacked on lo, [2M, K], measured 0.81-0.96x of this at 384 and
        1024 rows on the H200.)"""
        hl, amax = split
        self._cublas(hl[0], w, out)
        self._cublas(hl[1], w, out, accumulate=True)
        if amax is not _NULL:
            self.kernel("gemm.cu", "range_rescale")(self._amax_grid(out.size), (_ELEM_THREADS,),
                                                    (out, np.int64(out.size), amax))
        return out

    def _amax_grid(self, n4):
        return (min(self._grid1(n4)[0], 4 * self.sm_count),)   # a few blocks per SM: one atomic per block

    def _split8(self, x, amax=None):
        """x fp32 [M, K] -> (hi fp16 [M, K], lo e4m3 [M, K] scaled by a power of two, its inverse scale [1]):
        the scale comes from max |lo| on the device, so nothing waits for the host. ``amax``: that maximum,
        already made by x's producer (fp8.cu swiglu_inplace); otherwise lo_amax reads x for it."""
        cp = self.cp
        x = self._c(x)
        if x.size % 4 or x.data.ptr % 16:     # the kernels read float4s (twinned weights have K % 16 == 0)
            raise errors.DeviceError(f"split8 operand of {x.size} values at {x.data.ptr:#x} is not float4-aligned")
        inv = cp.empty(1, dtype=cp.float32)
        hi = cp.empty(x.shape, dtype=cp.float16)
        lo8 = cp.empty(x.shape, dtype=cp.uint8)
        n4 = x.size // 4
        if amax is None:
            amax = cp.zeros(1, dtype=cp.uint32)
            self.kernel("fp8.cu", "lo_amax")(self._amax_grid(n4), (_ELEM_THREADS,), (x, np.int64(n4), amax))
        self.kernel("fp8.cu", "split_fp8")(self._grid1(n4), (_ELEM_THREADS,), (x, hi, lo8, np.int64(n4), amax, inv))
        return hi, lo8, inv

    def _split8_gemm(self, s8, w, out):
        """out[M, N] fp32 = (hi + lo) @ w^T for s8 = _split8(x): lo against w's fp8 twin on the fp8 tensor cores
        (cuBLASLt, overwriting out), then hi against w in fp16 (cuBLAS, accumulating)."""
        hi, lo8, inv = s8
        _, w8, w_inv = self._twin_of(w)
        self._fp8(lo8, inv, w8, w_inv, out, self.cp.cuda.get_current_stream().ptr)
        return self._cublas(hi, w, out, accumulate=True)

    def _twin_of(self, w):
        """w's (weight, fp8 twin, inverse scale), or None. The pointer alone is not enough: a view of a weight's
        first rows (the head slices its attention in-projections) starts at the same address."""
        t = self._twins.get(w.data.ptr)
        return t if t is not None and t[0].shape == w.shape and w.flags.c_contiguous else None

    def _has_twin(self, M, *ws):
        """split8 applies: every weight has its fp8 twin and cuBLASLt runs the shape."""
        return (self.precision == "split8" and all(self._twin_of(w) is not None for w in ws)
                and all(self._fp8.supports(M, w.shape[0], w.shape[1]) for w in ws))

    def _gemm(self, x, w, out, bias=None):
        """out = x @ w^T (+ bias): x fp32 or fp16 [M, K] contiguous, w fp16 [N, K]; path by autotune."""
        M, K = x.shape
        N = w.shape[0]
        split = self.precision != "fp16" and x.dtype == self.cp.float32

        def cublas():
            if x.dtype == self.cp.float16:
                self._cublas(x, w, out)
            elif split and self._has_twin(M, w):
                self._split8_gemm(self._split8(x), w, out)
            elif split:
                self._split_gemm(self._split(x), w, out)
            else:
                self._cublas(self._half(x), w, out)
            if bias is not None:
                out.__iadd__(bias)

        paths = {"wmma": lambda: self._wmma(x, w, out, bias), "cublas": cublas}
        if M <= _ROWS_MAX_M and x.dtype == self.cp.float32:
            paths["rows"] = lambda: self._gemm_rows(x, w, out, bias)
        paths[self._choose(M, N, K, paths, str(x.dtype))]()
        return out

    def _gemm_rows(self, a, w16, out, bias=None):
        """gemm_rows.cu: the few-row GEMM on the CUDA cores (fp32 products; the head's questions and options)."""
        M, K = a.shape
        N = w16.shape[0]
        # a block: 16 weight rows (8 warps x NC = 2) against 16 activation rows (RG); gemm_rows.cu's constants
        self.kernel("gemm_rows.cu", "gemm_rows")((-(-N // 16), -(-M // 16)), (256,),
                                                 (a, w16, _NULL if bias is None else bias, out, np.int32(M),
                                                  np.int32(N), np.int32(K)))
        return out

    def _wmma(self, a, w16, out, bias=None, res=None):
        M, K = a.shape
        N = w16.shape[0]
        args = (a, w16, _NULL if bias is None else bias, _NULL if res is None else res, out, np.int32(M),
                np.int32(N), np.int32(K))
        grid = (-(-N // 128), -(-M // 128))
        if a.dtype == self.cp.float16:
            self.kernel("gemm.cu", "gemm_f16a")(grid, (256,), args)
        elif self.precision == "fp16":
            self.kernel("gemm.cu", "gemm_f32a")(grid, (256,), args)
        else:
            self.kernel("gemm.cu", "gemm_f32a_split")(grid, (256,), args + (self._range_amax(a),))
        return out

    def _choose(self, M, N, K, paths: dict, tag=""):
        """The fastest of ``paths`` (name -> run) for this shape (M rounded up to a power of two), timed the
        first time the shape is seen (best of 5 interleaved runs) and logged; ``gemm`` = wmma / cublas forces that
        path."""
        if self.gemm_mode != "auto":
            return self.gemm_mode
        if self.cublas_missing is not None:
            paths = {name: run for name, run in paths.items() if name != "cublas"}
        bucket = 1 << max(4, int(math.ceil(math.log2(max(M, 1)))))
        key = (N, K, bucket, tag, self.precision)
        got = self.gemm_choice.get(key)
        if got is None:
            cp = self.cp
            times = {name: math.inf for name in paths}
            for fn in paths.values():
                fn()                                   # compile, allocate, warm the clocks
            for _ in range(5):                         # interleaved, best of 5: a clock ramp or a hiccup during
                for name, fn in paths.items():         # one candidate's turn does not decide
                    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                    e0.record()
                    fn()
                    e1.record()
                    e1.synchronize()
                    times[name] = min(times[name], cp.cuda.get_elapsed_time(e0, e1))
            got = min(times, key=times.get)
            self.gemm_choice[key] = got
            log.info("gemm autotune M~%d N=%d K=%d %s: %s -> %s", bucket, N, K, tag,
                     ", ".join(f"{n} {t:.3f} ms" for n, t in times.items()), got)
        return got

    def linear(self, x, w, b=None):
        cp = self.cp
        if w.dtype != cp.float16:                     # small fp32 matrices (e.g. a [1, F] scorer row)
            # a reduction over broadcast views, not cuBLAS: CuPy's cuBLAS calls refuse a graph capture
            x2 = self._f32(x).reshape(-1, x.shape[-1])
            y = _rowdot_k()(x2[:, None, :], w[None, :, :], axis=2).reshape(x.shape[:-1] + (w.shape[0],))
            return y if b is None else y + b
        lead = x.shape[:-1]
        x = self._c(x).reshape(-1, x.shape[-1])
        M, K = x.shape
        N = w.shape[0]
        out = cp.empty((M, N), dtype=cp.float32)
        if M == 0:
            return out.reshape(lead + (N,))
        self._gemm(x, w, out, self._c(b) if b is not None else None)
        return out.reshape(lead + (N,))

    def mlp(self, x, w_gate, w_up, w_down):
        """SwiGLU, processed in token blocks so the [T, intermediate] activation stays small (model.backbone
        already hands it blocks of ``token_block`` rows; direct callers get the same bound). Two paths per
        block, chosen by autotune: wmma (SwiGLU fused into the gate/up GEMM's epilogue, then the down GEMM) and
        cuBLAS(Lt) for all three GEMMs (split8: the SwiGLU pass also yields the down GEMM's fp8 scale)."""
        cp = self.cp
        x = self._c(x)
        T, H = x.shape
        I = w_gate.shape[0]
        out = cp.empty((T, w_down.shape[0]), dtype=cp.float32)
        split = self.precision != "fp16"
        step = self.token_block if self.token_block > 0 else max(T, 1)
        for t0 in range(0, T, step):
            xb = x[t0:t0 + step]
            M = xb.shape[0]
            ob = out[t0:t0 + M]

            def run_w():
                hb = cp.empty((M, I), dtype=cp.float32 if split else cp.float16)
                grid = (-(-I // 64), -(-M // 128))
                args = (xb, w_gate, w_up, hb, np.int32(M), np.int32(I), np.int32(H))
                if split:
                    self.kernel("gemm.cu", "gemm_swiglu_f32a_split")(grid, (256,), args + (self._range_amax(xb),))
                else:
                    self.kernel("gemm.cu", "gemm_swiglu_f32a")(grid, (256,), args)
                self._gemm(hb, w_down, ob)            # its own autotune (wmma or cuBLAS)

            def run_c():                              # every GEMM on cuBLAS(Lt)
                gb = cp.empty((M, I), dtype=cp.float32)
                ub = cp.empty((M, I), dtype=cp.float32)
                if not split:
                    a16 = self._half(xb)
                    self._cublas(a16, w_gate, gb)
                    self._cublas(a16, w_up, ub)
                    del a16
                    hb = cp.empty((M, I), dtype=cp.float16)
                    self.kernel("gemm.cu", "swiglu_half")(self._grid1(gb.size), (_ELEM_THREADS,),
                                                          (gb, ub, hb, np.int64(gb.size)))
                    del gb, ub
                    self._cublas(hb, w_down, ob)
                    return
                if self._has_twin(M, w_gate, w_up):
                    hl, gemm = self._split8(xb), self._split8_gemm
                else:
                    hl, gemm = self._split(xb), self._split_gemm
                gemm(hl, w_gate, gb)
                gemm(hl, w_up, ub)
                del hl
                # gb <- silu(gb) * ub in place; for split8's down GEMM the same pass yields gb's lo amax
                twin = self._has_twin(M, w_down)
                amax = cp.zeros(1, dtype=cp.uint32) if twin else _NULL
                self.kernel("fp8.cu", "swiglu_inplace")(self._amax_grid(-(-gb.size // 4)), (_ELEM_THREADS,),
                                                        (ub, gb, np.int64(gb.size), amax))
                del ub
                if twin:
                    self._split8_gemm(self._split8(gb, amax), w_down, ob)
                else:
                    self._split_gemm(self._split(gb), w_down, ob)

            paths = {"wmma": run_w, "cublas": run_c}
            paths[self._choose(M, 2 * I, H, paths, "swiglu")]()
        return out

    # ------------------------------------------------------------------------------- attention path
    def sigmoid_gate(self, o, gate):
        return _sigmoid_gate_k()(self._f32(o), self._f32(gate))

    def rope_tables(self, positions, rotary_dim, theta):
        c, s = _rope_tables_host(np.asarray(self.to_host(positions)), rotary_dim, theta)
        return self._to_device(c), self._to_device(s)

    def rotary(self, x, cos, sin):
        T, H, D = x.shape
        xr, R, _, rs = self._rows(x)
        half = cos.shape[1]
        y = self.cp.empty((T, H, D), dtype=self.cp.float32)
        self.kernel("rotary.cu", "rotary_rows")(self._grid1(y.size), (_ELEM_THREADS,),
                                                (xr, np.int64(rs), self._c(cos), self._c(sin), y, np.int32(T),
                                                 np.int32(H), np.int32(D), np.int32(half)))
        return y

    def kv_cache(self, T, heads, D):
        """K (or V) rows of a whole packed stream for token-blocked attention, fp16 (what the kernel reads)."""
        return self.cp.empty((T, heads, D), dtype=self.cp.float16)

    def kv_write(self, cache, t0, x):
        """cache[t0:t0 + n] = x [n, heads, D], rounded to the cache's fp16 in one pass. x may be a strided view
        (v is a column slice of the fused q|k|v projection): CuPy's casting copy walks its strides."""
        self.cp.copyto(cache[t0:t0 + x.shape[0]], self._f32(x), casting="same_kind")

    def attention(self, q, k, v, cu_seqlens, scale, q_offset=0):
        """q [n, Hq, D] = query rows [q_offset, q_offset + n) of the packed stream; k/v [>= q_offset + n, Hkv, D]
        (fp16 cache or fp32) hold its rows from 0; cu_seqlens describes the whole stream (see cpu.attention)."""
        cp = self.cp
        n, hq, D = q.shape
        hkv = k.shape[1]
        if D not in (16, 32, 64, 128, 256) or v.shape[2] != D:
            raise errors.DeviceError(f"attention head dim {D} (value dim {v.shape[2]}) has no CUDA kernel")
        t0 = int(q_offset)
        t1 = t0 + n
        cu = np.asarray(self.to_host(cu_seqlens), dtype=np.int64)
        smem, warps = self._attn_shape(D)
        tiles = attention_tiles(cu, t0, t1, 16 * warps)
        out = cp.empty((n, hq, D), dtype=cp.float32)
        if not len(tiles):
            return out
        tl = self._upload(tiles)
        q16, k16, v16 = self._half(q), self._half(k[:t1]), self._half(v[:t1])
        fn = self.kernel("attention.cu", f"attn_fwd_d{D}", smem)
        for i in range(0, len(tiles), 65535):     # gridDim.y's limit (65,535 one-token sequences in one block)
            fn((hq, min(65535, len(tiles) - i)), (32 * warps,), (q16, k16, v16, out, tl[i:], np.int32(hq),
                                                                 np.int32(hkv), np.float32(scale), np.int32(t0)),
               shared_mem=smem)
        return out

    def _attn_shape(self, D):
        """(shared-memory bytes, warps per block) of attn_fwd_d{D} as compiled for this device (attention.cu
        chooses both per architecture): asked once from the module's attn_launch_d{D}."""
        got = self._attn_launch.get(D)
        if got is None:
            n = self.cp.zeros(2, dtype=self.cp.int32)
            self.kernel("attention.cu", f"attn_launch_d{D}")((1,), (1,), (n,))
            got = self._attn_launch[D] = tuple(int(v) for v in n.get())
        return got

    # ------------------------------------------------------------------------------------ GDN path
    def conv1d_silu(self, x, w, cu_seqlens, prev=None):
        """See cpu.conv1d_silu: prev [K-1, C] = pre-conv rows before x[0], read by the first sequence only."""
        cp = self.cp
        x, R, C, xs = self._rows(x)
        T = R
        K = w.shape[1]
        cu = np.asarray(self.to_host(cu_seqlens), dtype=np.int64)
        starts = np.repeat(cu[:-1], np.diff(cu)).astype(np.int32)
        y = cp.empty((T, C), dtype=cp.float32)
        if prev is not None:
            prev = self._c(prev)
            if prev.shape != (K - 1, C):
                raise ValueError(f"conv prev must be [{K - 1}, {C}], got {prev.shape}")
        if K > _CONV_KMAX:
            raise errors.DeviceError(f"conv1d kernel size {K}: the CUDA kernel takes at most {_CONV_KMAX} taps")
        grid = (-(-C // 128), -(-T // _CONV_TT))
        self.kernel("conv1d.cu", "conv1d_silu_k")(grid, (128,), (x, np.int64(xs), self._c(w), self._upload(starts),
                                                               _NULL if prev is None else prev, y,
                                                               np.int32(T), np.int32(C), np.int32(K)))
        return y

    def gdn_gates(self, a, b, a_log, dt_bias):
        g, beta = _gdn_gates_k()(self._f32(a), self._f32(b), self._f32(a_log), self._f32(dt_bias))
        return g, beta

    def gated_delta_rule(self, q, k, v, g, beta, cu_seqlens, state=None):
        """cuda/gated_delta.cu: gdn_prep, gdn_scan, gdn_out per group of chunks. state: None or fp32
        [B, hv, dk, dv], read at each sequence's start and overwritten in place with its final state."""
        cp = self.cp
        T, hk, dk = k.shape
        hv, dv = v.shape[1], v.shape[2]
        C = GDN_CHUNK
        if dk % 16 or dv % 16 or dk > 128 or dv > 128:
            raise errors.DeviceError(f"gated delta rule with dk={dk}, dv={dv}: the kernels need multiples of 16 "
                                     "up to 128")
        cu = np.asarray(self.to_host(cu_seqlens), dtype=np.int64)
        nb = len(cu) - 1
        st = None
        if state is not None:
            if tuple(state.shape) != (nb, hv, dk, dv) or state.dtype != cp.float32:
                raise ValueError(f"state must be float32 [{nb}, {hv}, {dk}, {dv}], got {state.dtype} {state.shape}")
            st = state if state.flags.c_contiguous and state.data.ptr % 256 == 0 else cp.ascontiguousarray(state)
        q, k = self._c(q), self._c(k)
        g, beta = self._c(g), self._c(beta)
        # v may be a column slice of the conv output: [T, hv, dv] with a token stride
        v = self._f32(v)
        if not (v.strides[2] == 4 and v.strides[1] == dv * 4 and v.data.ptr % 4 == 0):
            v = cp.ascontiguousarray(v)
        vs = v.strides[0] // 4
        chunks, seq_of = [], []
        for b_, (s0, s1) in enumerate(zip(cu[:-1], cu[1:])):
            for c0 in range(int(s0), int(s1), C):
                chunks.append((c0, min(C, int(s1) - c0), 0, 0))
                seq_of.append(b_)
        out = cp.empty((T, hv, dv), dtype=cp.float32)
        if not chunks:
            return out
        if st is None:
            st = cp.empty((nb, hv, dk, dv), dtype=cp.float32)
        chunks_np = np.array(chunks, dtype=np.int32)
        seq_of = np.array(seq_of)
        LK, LX = dk + 8, max(dk, dv) + 8
        prep_smem = 4 * C * LK + max(4 * C * LX, 4 * C * (C + 4)) + 4 * C * (C + 8) + 8192 + 4 * C * 4
        bv = self._gdn_bv(hv, dv, len(np.unique(seq_of)))
        scan_smem = 4 * dk * (dk + 8) + 4 * dk * (bv + 8) + 8192
        out_smem = 4 * C * (dk + 8) + 4 * dk * 72 + 8192
        sfx = "_d128" if dk == dv == 128 else ""          # the model's size, with its index arithmetic folded
        prep = self.kernel("gated_delta.cu", "gdn_prep" + sfx, prep_smem)
        scan = self.kernel("gated_delta.cu", "gdn_scan" + sfx, scan_smem)
        outk = self.kernel("gated_delta.cu", "gdn_out" + sfx, out_smem)
        # workspace per (chunk, value head): N fp32, M' / Q' / entering state as fp16 hi + lo (224 KB at 128 x 128);
        # chunks per group: gdn_block_chunks, and at most 256 MiB of workspace (36 chunks at 32 heads of 128)
        per = hv * (4 * dk * dv + 4 * dk * dk + 4 * C * dk + 4 * dk * dv)
        ncap = max(1, min(self.gdn_block_chunks, len(chunks), (256 << 20) // per))
        # groups of equal size (64 chunks: 32 + 32, not 36 + 28): gdn_prep's grid then ends in fewer part-full waves
        ncap = -(-len(chunks) // -(-len(chunks) // ncap))
        Nw = cp.empty((ncap, hv, dk, dv), dtype=cp.float32)
        Mw = cp.empty((ncap, hv, 2, dk, dk), dtype=cp.float16)
        Qw = cp.empty((ncap, hv, 2, C, dk), dtype=cp.float16)
        Hw = cp.empty((ncap, hv, 2, dk, dv), dtype=cp.float16)
        i32 = np.int32
        for c0 in range(0, len(chunks), ncap):
            c1 = min(c0 + ncap, len(chunks))
            ch = self._upload(chunks_np[c0:c1])
            prep((c1 - c0, hv), (256,), (q, k, v, np.int64(vs), g, beta, ch, i32(hk), i32(hv), i32(dk), i32(dv), out,
                                         Nw, Mw, Qw), shared_mem=prep_smem)
            seqs = []
            for b_ in np.unique(seq_of[c0:c1]):
                idx = np.nonzero(seq_of[c0:c1] == b_)[0]
                first_global = c0 + idx[0]
                zero = state is None and (first_global == 0 or seq_of[first_global - 1] != b_)
                seqs.append((int(idx[0]), int(idx[-1]) + 1, int(zero), int(b_)))
            sq = self._upload(np.array(seqs, dtype=np.int32))
            scan((hv, dv // bv, len(seqs)), (256,), (sq, i32(hv), i32(dk), i32(dv), i32(bv), Nw, Mw, st, Hw),
                 shared_mem=scan_smem)
            outk((c1 - c0, hv, -(-dv // 64)), (256,), (ch, i32(hv), i32(dk), i32(dv), Qw, Hw, out),
                 shared_mem=out_smem)
        if state is not None and st is not state:
            state[...] = st
        return out

    def _gdn_bv(self, hv, dv, nseq):
        """State columns per gdn_scan block (one block per SM: its latency, not its work, sets the time):
        32 (two tiles per warp share the M' fragments), or 16 when twice the blocks still fit on the SMs."""
        return 32 if dv % 32 == 0 and 2 * hv * (dv // 32) * nseq > self.sm_count else 16

    # ---------------------------------------------------------------------------------------- head
    def gelu(self, x):
        return _gelu_k()(self._f32(x))

    def mha(self, xq, xkv, in_w, in_b, out_w, out_b, heads, groups=None):
        """See cpu.mha. With groups the scores are masked per query block, each block against the key range of
        its groups only, in blocks that keep the score matrix under 64 MiB."""
        cp = self.cp
        check_groups(groups)
        W = xq.shape[-1]
        d = W // heads
        # one GEMM per distinct input: [q | k | v] for self-attention, [k | v] of the memory for cross-attention
        # (wider products fill more of the GPU; the head's GEMMs are small)
        if xkv is xq:
            qkv = self.linear(xq, in_w, in_b)
            q, kv = qkv[:, :W], qkv[:, W:]
        else:
            q, kv = self.linear(xq, in_w[:W], in_b[:W]), self.linear(xkv, in_w[W:], in_b[W:])
        q = q.reshape(-1, heads, d).transpose(1, 0, 2)
        k = kv[:, :W].reshape(-1, heads, d).transpose(1, 2, 0)
        v = kv[:, W:].reshape(-1, heads, d).transpose(1, 0, 2)
        n, m = q.shape[1], v.shape[1]
        o = cp.empty((heads, n, d), dtype=cp.float32)
        rows = n if groups is None else max(1, (16 << 20) // max(1, heads * m))
        if groups is not None:
            gq, gk = self._upload(np.asarray(groups[0], np.int32)), self._upload(np.asarray(groups[1], np.int32))
        for b0 in range(0, n, rows):
            b1 = min(b0 + rows, n)
            k0, k1 = group_keys(groups, b0, b1, m)
            sc = self._bmm(q[:, b0:b1], k[:, :, k0:k1]) * np.float32(1.0 / math.sqrt(d))   # fp32, head only
            if groups is not None:
                sc = cp.where(gq[b0:b1, None] == gk[None, k0:k1], sc, np.float32(-np.inf))
            sc = cp.exp(sc - sc.max(axis=-1, keepdims=True))
            o[:, b0:b1] = self._bmm(sc / sc.sum(axis=-1, keepdims=True), v[:, k0:k1])
        return self.linear(o.transpose(1, 0, 2).reshape(-1, W), out_w, out_b)

    def _bmm(self, a, b):
        """fp32 batched a [h, n, k] @ b [h, k, m] (the head's attention scores and mix): CuPy's matmul (cuBLAS), or
        where cuBLAS cannot be loaded a reduction over broadcast views (nothing [h, n, m, k] is materialised)."""
        if self.cublas_missing is None:
            return self.cp.matmul(a, b)
        return _rowdot_k()(a[:, :, None, :], b.transpose(0, 2, 1)[:, None, :, :], axis=3)

    def span_means(self, x, starts, ends):
        cp = self.cp
        x = self._f32(x)
        c = cp.zeros((x.shape[0] + 1, x.shape[1]), dtype=cp.float64)
        cp.cumsum(x, axis=0, dtype=cp.float64, out=c[1:])
        s = np.asarray(self.to_host(starts), dtype=np.int64)
        e = np.asarray(self.to_host(ends), dtype=np.int64)
        n = self._to_device((e - s).astype(np.float64))[:, None]
        return ((c[self._to_device(e)] - c[self._to_device(s)]) / n).astype(cp.float32)

    def normalize(self, x, eps):
        cp = self.cp
        x = self._f32(x)
        return x / cp.maximum(cp.sqrt(cp.sum(x * x, axis=-1, keepdims=True)), np.float32(eps))

    def segment_softmax_sum(self, scores, values, owner, n_groups):
        cp = self.cp
        scores = self._f32(scores)
        values = self._f32(values)
        own = self.asarray(owner)
        m = cp.full(n_groups, -np.inf, dtype=cp.float32)
        cp.maximum.at(m, own, scores)
        e = cp.exp(scores - m[own])
        den = cp.zeros(n_groups, dtype=cp.float32)
        cp.add.at(den, own, e)
        out = cp.zeros((n_groups, values.shape[1]), dtype=cp.float32)
        cp.add.at(out, own, (e / den[own])[:, None] * values)
        return out

    # ------------------------------------------------------------------------------------- guards
    def _finite_flags(self, x, flags):
        x = self._c(x)
        # a grid-stride loop over at most 1024 blocks: few atomics, and enough blocks to fill the GPU
        grid = (int(min(max(1, -(-x.size // _ELEM_THREADS)), 1024)),)
        self.kernel("embed.cu", "finite_check")(grid, (_ELEM_THREADS,), (x, np.int64(x.size), flags))
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
        """Device bytes held by live arrays (weights included) and by the CUDA graphs' private pools (the server's
        device-memory gauge)."""
        used = int(self.cp.get_default_memory_pool().used_bytes()) + self.graphs.nbytes()
        return used + (int(self.pool.in_use) if self.pool is not None else 0)

    @contextmanager
    def fallback(self):
        """Run the enclosed forward on the range-safe exact path: split (no fp8 twins), with every split operand
        beyond fp16's range scaled by a power of two (range.cuh). In range, the result is split's bit for bit. The
        engine runs a batch here again when its guards tripped in the configured path."""
        saved = self.precision, self.range_safe
        self.precision, self.range_safe = "split", True
        self.fallbacks += 1
        try:
            yield
        finally:
            self.precision, self.range_safe = saved

    @property
    def variant(self) -> tuple:
        """What selects the kernels of a forward (CUDA graphs are kept per variant)."""
        return self.precision, self.range_safe

    def begin_forward(self):
        """Engine hook: every array made until end_forward() comes from the arena (clefcore.pool.Arena), so a
        forward never calls cudaMalloc. Drops guard records a failed forward may have left unread."""
        self._watched = []
        if self.pool is not None:
            self.pool.activate()

    def end_forward(self):
        if self.pool is not None:
            self.pool.deactivate()

    def synchronize(self):
        self.cp.cuda.Device(self.device_id).synchronize()


# ------------------------------------------------------------------------------------ CuPy elementwise

_K = {}


def _ek(name, *args):
    if name not in _K:
        import cupy
        _K[name] = cupy.ElementwiseKernel(*args, name=name)
    return _K[name]


def _rowdot_k():
    if "clef_rowdot" not in _K:
        import cupy
        _K["clef_rowdot"] = cupy.ReductionKernel("float32 x, float32 w", "float32 y", "x * w", "a + b", "y = a",
                                                 "0", name="clef_rowdot")
    return _K["clef_rowdot"]


def _sigmoid_k():
    return _ek("clef_sigmoid", "float32 x", "float32 y", "y = 1.0f / (1.0f + expf(-x))")


def _silu_k():
    return _ek("clef_silu", "float32 x", "float32 y", "y = x / (1.0f + expf(-x))")


def _sigmoid_gate_k():
    # numpy twin: clefcore/backends/cpu.py::sigmoid_gate
    return _ek("clef_sigmoid_gate", "float32 o, float32 g", "float32 y", "y = o / (1.0f + expf(-g))")


def _gelu_k():
    # numpy twin: clefcore/backends/cpu.py::gelu (exact erf GELU; evaluated in double like the reference)
    return _ek("clef_gelu", "float32 x", "float32 y",
               "double xd = (double)x; y = (float)(0.5 * xd * (1.0 + erf(xd * 0.7071067811865476)))")


def _gdn_gates_k():
    # numpy twin: clefcore/backends/cpu.py::gdn_gates
    return _ek("clef_gdn_gates", "float32 a, float32 b, float32 a_log, float32 dt_bias", "float32 g, float32 beta",
               "float z = a + dt_bias; float sp = z > 20.0f ? z : log1pf(expf(fminf(z, 20.0f)));"
               "g = -expf(a_log) * sp; beta = 1.0f / (1.0f + expf(-b));")
