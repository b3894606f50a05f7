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
from .attention import Attention
from .delta_rule import DeltaRule
from .device import DeviceContext
from .elementwise import ELEM_THREADS, sigmoid_k
from .graphs import GraphCache
from .head import Head
from .matmul import Matmul
from .norms import Norms
from .state import Fp8Twins, GemmChoices
from .vision import Vision

log = logging.getLogger("clefcore.cuda")

# the joint-head graphs kept, one per question schema and bucket of the stream's length (a graph's pool at 1,024
# tokens: a few tens of MB, its inputs' copies and the head's activations)
HEAD_GRAPHS = 8


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
    """The ``Backend`` on one GPU. This class holds the weights and tables, the guards and the forward hooks; each
    op is a call to the op object of its family, all of them on one ``DeviceContext`` (``ctx``: the GPU, the
    precision plan, the compiled kernels and the array helpers): ``norms`` (norms.py), ``matmul`` (matmul.py),
    ``attn`` (attention.py), ``delta_rule`` (delta_rule.py), ``head`` (head.py) and ``vision`` (vision.py).
    What they share beyond the context is in named objects: ``gemm`` (the GEMM choices) and ``twins`` (split8's
    fp8 weights, state.py)."""

    name = "cuda"
    falls_back = True
    # the Backend's data members, set in __init__ (plan and token_block: properties, read by the ops in ``ctx``)
    xp: object
    mode: str
    graphs: GraphCache
    tower_graphs: GraphCache
    head_graphs: GraphCache

    def __init__(self, device_id: int = 0, max_tokens: int = 32768, gemm: str = gpu_settings.GEMM_DEFAULT,
                 tables: str = "host", ptx70: bool = False, token_block: int = gpu_settings.TOKEN_BLOCK,
                 gdn_block_chunks: int = 128, precision: str = precision_modes.DEFAULT,
                 graph_tokens: int = gpu_settings.GRAPH_TOKENS, graphs: int = 4,
                 kernels: str | None = None):
        import cupy
        self.xp = cupy
        ctx = self.ctx = DeviceContext(cupy, device_id, ptx70, token_block)
        self.max_tokens = int(max_tokens)
        pin = gpu_settings.gemm_pin(gemm)
        if precision not in precision_modes.CHOICES:
            raise ValueError(f"precision must be one of {', '.join(precision_modes.CHOICES)}")
        if ctx.cublas_missing is not None:
            if pin is GemmRoute.CUBLAS:
                raise errors.DeviceError(f"gemm cublas: cuBLAS cannot be loaded ({ctx.cublas_missing})")
            log.warning("cuBLAS cannot be loaded (%s): every GEMM runs clefcore's own kernels", ctx.cublas_missing)
        self.gemm = GemmChoices(pin)
        fp8 = False
        if kernel_select.fp8_tensor_cores(ctx.caps):
            from . import cublaslt
            fp8 = cublaslt.available()
        # The kernel path and what each op family runs on it: a row of clefcore/precision.py's table (fp16 = one
        # rounding of each activation, fast; split = hi + lo fp16 halves, fp32-grade products with the fp16-exact
        # weights; split8 = the lo pass in fp8 against an fp8 twin of each weight, sm_89+, ~1.5 passes' time).
        # ``fallback`` switches the plan to the range-safe one.
        ctx.plan = Plan(precision_modes.resolve(precision, fp8))
        if ctx.plan.row.gemm.fp8_lo and not fp8:
            raise errors.DeviceError(f"precision {ctx.plan.path} needs fp8 tensor cores (compute capability 8.9 "
                                     f"or newer) and cuBLASLt; {ctx.device_name} is {ctx.cc[0]}.{ctx.cc[1]}"
                                     + ("" if ctx.cublas_missing is None else ", without cuBLAS"))
        self.mode = ctx.plan.row.mode
        self.twins = Fp8Twins()
        if ctx.plan.row.gemm.fp8_lo:
            from . import cublaslt
            self.twins.gemm = cublaslt.Fp8Gemm(cupy)
        # the kernel switches in effect (clefcore/switches.py): the kernels option, else the environment
        ctx.switches = switches.resolve(kernels)
        if ctx.switches:
            log.info("kernel switches on: %s", ", ".join(sorted(s.name for s in ctx.switches)))
        self.tables = tables
        self.arena = None            # clefcore.pool.Arena, once reserve() has sized it
        self.fp16_overflow = 0       # weight values saturated to +-65504
        self.fp16_underflow = 0      # nonzero weight values that became 0 in fp16
        self._counts = cupy.zeros(2, dtype=cupy.uint64)
        # the op families, each on the context, and given the others it calls
        self.matmul = Matmul(ctx, self.gemm, self.twins)
        self.norms = Norms(ctx, self.matmul)
        self.attn = Attention(ctx, self.matmul)
        self.delta_rule = DeltaRule(ctx, gdn_block_chunks)
        self.head = Head(ctx, self.matmul)
        self.vision = Vision(ctx, self.matmul, self.attn)
        # single-sequence prompts up to graph_tokens replay a CUDA graph (0 = never)
        self.graphs = GraphCache(ctx, graph_tokens, graphs)
        # the vision tower's graphs (fast mode, per set of image sizes) in a cache of their own, so that the image
        # sizes a service sees never evict the short prompts' graphs
        self.tower_graphs = GraphCache(ctx, graph_tokens, 2)
        # the joint head's graphs, one per question schema and bucket of the stream's length (model/head.py)
        self.head_graphs = GraphCache(ctx, graph_tokens, HEAD_GRAPHS)

    @property
    def plan(self) -> Plan:
        """The next forward's kernel path and its row (``fallback`` switches it): the context's, read by the ops."""
        return self.ctx.plan

    @plan.setter
    def plan(self, plan: Plan) -> None:
        self.ctx.plan = plan

    @property
    def token_block(self) -> int:
        """The backbone's token block (0 = the whole stream): the context's, which ``mlp`` reads."""
        return self.ctx.token_block

    @token_block.setter
    def token_block(self, tokens: int) -> None:
        self.ctx.token_block = tokens

    # ------------------------------------------------------------------------------ interface basics
    def asarray(self, x):
        return self.ctx.asarray(x)

    def to_host(self, x) -> np.ndarray:
        return self.ctx.to_host(x)

    def weight(self, w):
        """A checkpoint tensor (TensorRef, or an fp32 host array) for this backend: matrices (both dims >= 16)
        -> fp16, converted on the device and counted (a bf16 matrix travels as its 2-byte bits and is never
        widened on the host); the rest fp32."""
        from ...checkpoint import TensorRef, to_float32
        cp = self.ctx.cp
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
        cp = self.ctx.cp
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
        self.ctx.kernel("fp8.cu", "half_to_e4m3")(self.ctx.grid1(w16.size), (ELEM_THREADS,),
                                                  (w16, w8, np.int64(w16.size), np.float32(s)))
        twins.by_ptr[w16.data.ptr] = (w16, w8, cp.asarray(np.array([1.0 / s], np.float32)))
        return w16

    def _to_half_counted(self, src, kernel: str):
        out = self.ctx.cp.empty(src.shape, dtype=self.ctx.cp.float16)
        self._counts.fill(0)
        self.ctx.kernel("gemm.cu", kernel)(self.ctx.grid1(src.size), (ELEM_THREADS,),
                                           (src, out, np.int64(src.size), self._counts))
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
            cp = self.ctx.cp
            if ref.dtype == "BF16":
                return DeviceTable(cp.asarray(np.ascontiguousarray(ref.raw)), ref.shape)
            from ...checkpoint import bf16_bits, to_float32
            return DeviceTable(cp.asarray(bf16_bits(to_float32(ref))), ref.shape)
        return HostTable(ref)

    def _widen_rows(self, table, ids):
        ctx = self.ctx
        cp = ctx.cp
        ids_h = np.asarray(self.to_host(ids), dtype=np.int64).reshape(-1)
        D = table.shape[1]
        out = cp.empty((ids_h.size, D), dtype=cp.float32)
        if ids_h.size == 0:
            return out
        if isinstance(table, DeviceTable):
            dids = ctx.to_device(ids_h)
            ctx.kernel("embed.cu", "gather_bf16_rows")(ctx.grid1(out.size), (ELEM_THREADS,),
                                                       (table.bits, dids, out, np.int32(ids_h.size), np.int32(D)))
            return out
        rows = table.rows(ids_h)
        if table.dtype == "BF16":
            dev = ctx.to_device(rows)
            ctx.kernel("embed.cu", "widen_bf16")(ctx.grid1(out.size), (ELEM_THREADS,),
                                                 (dev, out, np.int64(out.size)))
            return out
        return ctx.to_device(rows.astype(np.float32))

    def gather_rows(self, table, ids):
        if isinstance(table, (HostTable, DeviceTable)):
            return self._widen_rows(table, ids)
        return self.ctx.f32(table)[self.asarray(ids)]

    def embed(self, table, ids):
        return self.gather_rows(table, ids)

    def sigmoid(self, x):
        return sigmoid_k()(self.ctx.f32(x))

    # ------------------------------------------------------------------- the ops, by their op object
    # norms.py
    def rmsnorm(self, x, w, eps, gemm_input=False):
        return self.norms.rmsnorm(x, w, eps, gemm_input)

    def add_rmsnorm(self, x, delta, w, eps, gemm_input=False):
        return self.norms.add_rmsnorm(x, delta, w, eps, gemm_input)

    def gated_rmsnorm(self, x, z, w, eps, gemm_input=False):
        return self.norms.gated_rmsnorm(x, z, w, eps, gemm_input)

    def layernorm(self, x, w, b, eps=1e-5):
        return self.norms.layernorm(x, w, b, eps)

    def l2norm(self, x, eps, scale=1.0):
        return self.norms.l2norm(x, eps, scale)

    # matmul.py
    def linear(self, x, w, b=None):
        return self.matmul.linear(x, w, b)

    def mlp(self, x, w_gate, w_up, w_down):
        return self.matmul.mlp(x, w_gate, w_up, w_down)

    def gemm_with(self, route: GemmRoute, x, w, out, bias=None):
        """out = x @ w^T (+ bias) by one GEMM ``route`` (Matmul.gemm_with): the kernel benchmarks' entry."""
        return self.matmul.gemm_with(route, x, w, out, bias)

    def gemm_routes(self):
        """A block that records the route each GEMM took (Matmul.gemm_routes): the benchmarks' report."""
        return self.matmul.gemm_routes()

    # attention.py
    def rope_tables(self, positions, rotary_dim, theta):
        return self.attn.rope_tables(positions, rotary_dim, theta)

    def rotary(self, x, cos, sin):
        return self.attn.rotary(x, cos, sin)

    def kv_cache(self, T, heads, D):
        return self.attn.kv_cache(T, heads, D)

    def kv_write(self, cache, t0, x):
        return self.attn.kv_write(cache, t0, x)

    def attention(self, q, k, v, cu_seqlens, scale, q_offset=0):
        return self.attn.attention(q, k, v, cu_seqlens, scale, q_offset)

    def sigmoid_gate(self, o, gate, gemm_input=False):
        return self.attn.sigmoid_gate(o, gate, gemm_input)

    # delta_rule.py
    def conv1d_silu(self, x, w, cu_seqlens, prev=None):
        return self.delta_rule.conv1d_silu(x, w, cu_seqlens, prev)

    def gdn_gates(self, a, b, a_log, dt_bias):
        return self.delta_rule.gdn_gates(a, b, a_log, dt_bias)

    def gated_delta_rule(self, q, k, v, g, beta, cu_seqlens, state=None):
        return self.delta_rule.gated_delta_rule(q, k, v, g, beta, cu_seqlens, state)

    def gdn_kernels(self):
        """The delta rule's kernels this backend runs now (DeltaRule.kernels)."""
        return self.delta_rule.kernels()

    # head.py
    def gelu(self, x):
        return self.head.gelu(x)

    def mha(self, xq, xkv, in_w, in_b, out_w, out_b, heads, groups=None, group_ids=None):
        return self.head.mha(xq, xkv, in_w, in_b, out_w, out_b, heads, groups, group_ids)

    def span_means(self, x, starts, ends):
        return self.head.span_means(x, starts, ends)

    def normalize(self, x, eps):
        return self.head.normalize(x, eps)

    def segment_softmax_sum(self, scores, values, owner, n_groups):
        return self.head.segment_softmax_sum(scores, values, owner, n_groups)

    # vision.py
    def patch_rows(self, images):
        return self.vision.patch_rows(images)

    def vision_attention(self, x, qkv_w, qkv_b, proj_w, proj_b, heads, cos, sin, cu_seqlens):
        return self.vision.vision_attention(x, qkv_w, qkv_b, proj_w, proj_b, heads, cos, sin, cu_seqlens)

    def vision_mlp(self, x, w1, b1, w2, b2):
        return self.vision.vision_mlp(x, w1, b1, w2, b2)

    # ------------------------------------------------------------------------------------- guards
    def _finite_flags(self, x, flags):
        x = self.ctx.contiguous(x)
        # a grid-stride loop over at most 1024 blocks: few atomics, and enough blocks to fill the GPU
        grid = (int(min(max(1, -(-x.size // ELEM_THREADS)), 1024)),)
        self.ctx.kernel("embed.cu", "finite_check")(grid, (ELEM_THREADS,), (x, np.int64(x.size), flags))
        return x.size

    def _raise_if_bad(self, what, size, bad, nz):
        if bad:
            raise errors.GuardError(f"{what}: {bad} of {size} values are NaN or Inf on {self.ctx.device_name}", what)
        if size and nz == 0:
            raise errors.GuardError(f"{what}: all {size} values are zero on {self.ctx.device_name}", what)

    def check_finite(self, x, what: str = "output"):
        """Raise DeviceError when x holds NaN/Inf or is entirely zero (a silently dead kernel)."""
        flags = self.ctx.cp.zeros(2, dtype=self.ctx.cp.uint64)
        size = self._finite_flags(x, flags)
        self._raise_if_bad(what, size, *(int(v) for v in flags.get()))

    def watch(self, x, what: str):
        """check_finite without waiting: the flags are read once, by check_watched() at the end of the forward."""
        flags = self.ctx.cp.zeros(2, dtype=self.ctx.cp.uint64)
        self.ctx.watched.append((what, self._finite_flags(x, flags), flags))

    def check_watched(self):
        ctx = self.ctx
        watched, ctx.watched = ctx.watched, []
        if watched:
            counts = self.ctx.cp.stack([f for _, _, f in watched]).get()
            ctx.staged.clear()
            for (what, size, _), (bad, nz) in zip(watched, counts):
                self._raise_if_bad(what, size, int(bad), int(nz))

    def memory_in_use(self) -> int:
        """Device bytes held by live arrays (weights included), the CUDA graphs' own arenas and the arena's
        whole reservation (the server's device-memory gauge)."""
        graphs = [g for g in (self.graphs, self.tower_graphs, self.head_graphs) if g is not None]
        used = int(self.ctx.cp.get_default_memory_pool().used_bytes()) + sum(g.nbytes() for g in graphs)
        return used + sum(int(a.capacity) for a in _arenas(self))

    def status(self) -> dict:
        """For /health and /metrics: whether cuBLAS is loaded, and why not where it is not (every GEMM then runs
        clefcore's own kernels); the bytes reserve() holds and how many allocations went beyond them."""
        arenas = _arenas(self)
        missing = self.ctx.cublas_missing
        info: dict = {"cublas": missing is None,
                      "reserved_bytes": sum(int(a.capacity) for a in arenas),
                      "reserve_overflows": sum(int(a.overflows) for a in arenas)}
        if missing is not None:
            info["cublas_missing"] = str(missing)
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
        self.ctx.watched = []
        if self.arena is not None:
            self.arena.activate()

    def end_forward(self):
        if self.arena is not None:
            self.arena.deactivate()

    def synchronize(self):
        self.ctx.device.synchronize()


def _arenas(ops) -> list:
    """The arenas reserve() made: the forwards' and the memoised index tables'."""
    return [a for a in (ops.arena, ops.ctx.caches.upload_arena) if a is not None]
