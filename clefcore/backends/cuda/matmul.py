"""The GEMMs of the CUDA backend (``Matmul``): their operands as the precision plan's row says
(``DeviceContext.plan.row.gemm``: rounded once to fp16; split hi + lo; split8 with fp8 twins, ``Fp8Twins``; and the
range-safe fallback's scaling), their routes (clefcore's own kernels, cuda/gemm.cu, cuda/gemm_rows.cu,
cuda/gemm_mma.cu, against cuBLAS(Lt)), chosen per shape by a timed trial (``GemmChoices``) among the candidates
clefcore/kernel_select.py names, the SwiGLU MLP, and the fp32 batched products of the head's and the vision tower's
attention. A new GEMM kernel is a ``GemmRoute``, a branch of ``gemm_with`` and a candidate in kernel_select.py."""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager

import numpy as np

from ... import errors, kernel_select
from ...kernel_select import GemmRoute, Products
from . import cublas
from .device import DeviceContext
from .elementwise import ELEM_THREADS, NULL, rowdot_k
from .state import Fp8Twins, GemmChoices

log = logging.getLogger("clefcore.cuda")

# Each "mma" tile's twin (kernel_select.MMA_TILES, WGMMA_TILE) for the fast plan's MLP (Row.fused_elementwise):
# the gate and up projections as one GEMM over their rows paired 8 by 8 (cuda/gemm_swiglu.cuh), SwiGLU in its
# epilogue, fp16 out; same tile, shared memory and launch as the plain kernel.
MMA_SWIGLU = {"gemm_mma_f16a_big": "gemm_mma_swiglu_big", "gemm_mma_f16a": "gemm_mma_swiglu",
              "gemm_wgmma_f16a": "gemm_wgmma_swiglu"}


def shape_key(M, N, K, tag, path) -> tuple:
    """The autotune's key of a GEMM (``GemmChoices.chosen``): (N, K, M rounded up to a power of two of at
    least 16, operand tag, kernel path)."""
    return N, K, 1 << max(4, int(math.ceil(math.log2(max(M, 1))))), tag, path


def swiglu_paired_rows(N: int) -> int:
    """Rows of the gate/up pairing of N-row gate and up weights (cuda/gemm_swiglu.cuh): 16 per 8 outputs."""
    return 16 * -(-N // 8)


class Matmul:
    """Every GEMM of the CUDA backend on ``ctx``: ``linear`` and ``mlp`` (the Backend's), ``gemm`` (a GEMM by the
    autotune's route), ``gemm_with`` (by a given route) and the routes themselves, ``bmm`` (fp32 batched products),
    and ``operand_dtype`` (the dtype a GEMM's activation is written in by its producer). ``choices``: the routes
    the autotune chose; ``twins``: split8's fp8 weights."""

    def __init__(self, ctx: DeviceContext, choices: GemmChoices, twins: Fp8Twins):
        self.ctx = ctx
        self.choices = choices
        self.twins = twins

    def operand_dtype(self, rows: int):
        """The dtype an op asked for a GEMM's activation (``gemm_input``) writes it in, for a GEMM of ``rows``
        rows (kernel_select.gemm_operand)."""
        op = kernel_select.gemm_operand(self.ctx.setting, rows)
        return self.ctx.cp.float16 if op is kernel_select.Operand.FP16 else self.ctx.cp.float32

    def cublas(self, a16, w16, out, accumulate=False):
        """out[M, N] fp32 (+)= a16[M, K] @ w16[N, K]^T through cublasGemmEx (fp32 compute), current stream."""
        M, K = a16.shape
        cublas.gemm(self.ctx.device.cublas_handle, a16.data.ptr, w16.data.ptr, out.data.ptr, M, w16.shape[0], K,
                    self.ctx.cp.cuda.get_current_stream().ptr, accumulate)
        return out

    def range_amax(self, x):
        """The range-safe fallback's max |x| (fp32 bits, on the device) for range.cuh's scaling; NULL otherwise."""
        ctx = self.ctx
        if not ctx.plan.range_safe:
            return NULL
        amax = ctx.cp.zeros(1, dtype=ctx.cp.uint32)
        ctx.kernel("gemm.cu", "abs_amax")(self.amax_grid(x.size), (ELEM_THREADS,), (x, np.int64(x.size), amax))
        return amax

    def split(self, x):
        """x fp32 [M, K] -> (fp16 [2, M, K]: hi = fp16(x) over lo = fp16(x - hi), amax): in the range-safe fallback
        x is first scaled by a power of two when it exceeds fp16's range (amax says by how much)."""
        ctx = self.ctx
        x = ctx.contiguous(x)
        amax = self.range_amax(x)
        hl = ctx.cp.empty((2,) + x.shape, dtype=ctx.cp.float16)
        ctx.kernel("gemm.cu", "to_half_split")(ctx.grid1(x.size), (ELEM_THREADS,),
                                               (x, hl[0], hl[1], np.int64(x.size), amax))
        return hl, amax

    def split_gemm(self, split, w, out):
        """out[M, N] fp32 = (hi + lo) @ w^T for split = split(x): two cuBLAS passes, the second accumulating, then
        the range scaling undone. (One pass over hi stacked on lo, [2M, K], measured 0.81-0.96x of this at 384 and
        1024 rows on the H200.)"""
        hl, amax = split
        self.cublas(hl[0], w, out)
        self.cublas(hl[1], w, out, accumulate=True)
        if amax is not NULL:
            self.ctx.kernel("gemm.cu", "range_rescale")(self.amax_grid(out.size), (ELEM_THREADS,),
                                                        (out, np.int64(out.size), amax))
        return out

    def amax_grid(self, n4):
        """The grid of the kernels that reduce a maximum (one atomic per block): a few blocks per SM."""
        return (min(self.ctx.grid1(n4)[0], 4 * self.ctx.sm_count),)

    def split8(self, x, amax=None):
        """x fp32 [M, K] -> (hi fp16 [M, K], lo e4m3 [M, K] scaled by a power of two, its inverse scale [1]):
        the scale comes from max |lo| on the device, so nothing waits for the host. ``amax``: that maximum,
        already made by x's producer (fp8.cu swiglu_inplace); otherwise lo_amax reads x for it."""
        ctx = self.ctx
        cp = ctx.cp
        x = ctx.contiguous(x)
        if x.size % 4 or x.data.ptr % 16:     # the kernels read float4s (twinned weights have K % 16 == 0)
            raise errors.DeviceError(f"split8 operand of {x.size} values at {x.data.ptr:#x} is not float4-aligned")
        inv = cp.empty(1, dtype=cp.float32)
        hi = cp.empty(x.shape, dtype=cp.float16)
        lo8 = cp.empty(x.shape, dtype=cp.uint8)
        n4 = x.size // 4
        if amax is None:
            amax = cp.zeros(1, dtype=cp.uint32)
            ctx.kernel("fp8.cu", "lo_amax")(self.amax_grid(n4), (ELEM_THREADS,), (x, np.int64(n4), amax))
        ctx.kernel("fp8.cu", "split_fp8")(ctx.grid1(n4), (ELEM_THREADS,), (x, hi, lo8, np.int64(n4), amax, inv))
        return hi, lo8, inv

    def split8_gemm(self, s8, w, out):
        """out[M, N] fp32 = (hi + lo) @ w^T for s8 = split8(x): lo against w's fp8 twin on the fp8 tensor cores
        (cuBLASLt, overwriting out), then hi against w in fp16 (cuBLAS, accumulating)."""
        hi, lo8, inv = s8
        _, w8, w_inv = self.twins.of(w)
        self.twins.gemm(lo8, inv, w8, w_inv, out, self.ctx.cp.cuda.get_current_stream().ptr)
        return self.cublas(hi, w, out, accumulate=True)

    def has_twin(self, M, *ws):
        """split8 applies: the plan's lo halves go in fp8, every weight has its fp8 twin and cuBLASLt runs the
        shape."""
        return self.ctx.plan.row.gemm.fp8_lo and self.twins.cover(M, *ws)

    def gemm_with(self, route: GemmRoute, x, w, out, bias=None):
        """out = x @ w^T (+ bias) by one ``route``, whatever the autotune would pick: x fp32 [M, K] contiguous
        (fp16 for cublas and wmma too), w fp16 [N, K]; split8 needs w's fp8 twin (``CudaOps.twin``). wmma runs
        fp16 or split operands as the plan's row says."""
        if route is GemmRoute.WMMA:
            return self.wmma(x, w, out, bias)
        if route is GemmRoute.ROWS:
            return self.gemm_rows(x, w, out, bias)
        if route is GemmRoute.MMA:
            return self.mma(self.ctx.half(x), w, out, bias)
        if route is GemmRoute.CUBLAS:
            self.cublas(self.ctx.half(x), w, out)
        elif route is GemmRoute.SPLIT:
            self.split_gemm(self.split(x), w, out)
        elif route is GemmRoute.SPLIT8:
            self.split8_gemm(self.split8(x), w, out)
        else:
            raise ValueError(f"gemm route {route!r}: expected one of {', '.join(r.value for r in GemmRoute)}")
        if bias is not None:
            out.__iadd__(bias)
        return out

    def gemm(self, x, w, out, bias=None):
        """out = x @ w^T (+ bias): x fp32 or fp16 [M, K] contiguous, w fp16 [N, K]; route by autotune. On cuBLAS
        an fp16 x goes as it is, an fp32 one as the plan's row says (rounded once, split, or split8 where w has a
        twin)."""
        M, K = x.shape
        N = w.shape[0]
        s, x16 = self.ctx.setting, x.dtype == self.ctx.cp.float16

        def run(route):
            if route is GemmRoute.CUBLAS:     # which of cuBLAS's routes: asked when it runs, as has_twin costs
                return lambda: self.gemm_with(kernel_select.cublas_route(s, x16, lambda: self.has_twin(M, w)),
                                              x, w, out, bias)
            return lambda: self.gemm_with(route, x, w, out, bias)

        routes = {route: run(route) for route in kernel_select.gemm_candidates(s, M, K, x16)}
        routes[self.choose(M, N, K, routes, str(x.dtype))]()
        return out

    def gemm_rows(self, a, w16, out, bias=None):
        """gemm_rows.cu: the few-row GEMM on the CUDA cores (fp32 products; the head's questions and options)."""
        M, K = a.shape
        N = w16.shape[0]
        # a block: 16 weight rows (8 warps x NC = 2) against 16 activation rows (RG); gemm_rows.cu's constants
        self.ctx.kernel("gemm_rows.cu", "gemm_rows")((-(-N // 16), -(-M // 16)), (256,),
                                                     (a, w16, NULL if bias is None else bias, out, np.int32(M),
                                                      np.int32(N), np.int32(K)))
        return out

    def mma_tile(self):
        """The "mma" route's kernel here: (module, (name, block rows, block columns, dynamic shared memory))."""
        got = kernel_select.mma_tile(self.ctx.caps)
        if got is None:
            raise errors.DeviceError(f"the mma GEMM route does not run on {self.ctx.device_name}")
        return got

    def mma(self, a16, w16, out, bias=None, res=None):
        """gemm_mma.cu (gemm_wgmma.cu on sm_90): out[M, N] fp32 = a16[M, K] @ w16[N, K]^T (+ bias) (+ res), both
        operands fp16 and 16-byte aligned (``DeviceContext.half``; weights are)."""
        M, K = a16.shape
        N = w16.shape[0]
        if w16.data.ptr % 16:
            raise errors.DeviceError(f"gemm_mma: weight at {w16.data.ptr:#x} is not 16-byte aligned")
        module, (name, bm, bn, smem) = self.mma_tile()
        fn = self.ctx.kernel(module, name, smem)
        fn((-(-N // bn), -(-M // bm)), (256,), (a16, w16, NULL if bias is None else bias,
                                                NULL if res is None else res, out, np.int32(M), np.int32(N),
                                                np.int32(K)), shared_mem=smem)
        return out

    def mma_swiglu(self, a16, w_gate, w_up, h16):
        """The fused MLP's first half on the "mma" route: h16[M, I] fp16 = fp16(silu(a16 @ w_gate^T) * (a16 @
        w_up^T)), one kernel (MMA_SWIGLU) over the gate and up rows paired (cuda/gemm_swiglu.cuh). Each output's
        gate and up sums are the plain kernel's, term for term; SwiGLU is swiglu_half's: the bits of two ``mma``
        calls and gemm.cu's swiglu_half."""
        M, K = a16.shape
        I = w_gate.shape[0]
        for w in (w_gate, w_up):
            if w.data.ptr % 16:
                raise errors.DeviceError(f"gemm_mma swiglu: weight at {w.data.ptr:#x} is not 16-byte aligned")
        module, (name, bm, bn, smem) = self.mma_tile()
        fn = self.ctx.kernel(module, MMA_SWIGLU[name], smem)
        fn((-(-swiglu_paired_rows(I) // bn), -(-M // bm)), (256,),
           (a16, w_gate, w_up, h16, np.int32(M), np.int32(I), np.int32(K)), shared_mem=smem)
        return h16

    def wmma(self, a, w16, out, bias=None, res=None):
        """gemm.cu's WMMA kernels: out[M, N] fp32 = a[M, K] @ w16[N, K]^T (+ bias) (+ res); a fp16, or fp32 rounded
        once or split as the plan's row says."""
        ctx = self.ctx
        M, K = a.shape
        N = w16.shape[0]
        args = (a, w16, NULL if bias is None else bias, NULL if res is None else res, out, np.int32(M),
                np.int32(N), np.int32(K))
        grid = (-(-N // 128), -(-M // 128))
        if a.dtype == ctx.cp.float16:
            ctx.kernel("gemm.cu", "gemm_f16a")(grid, (256,), args)
        elif ctx.plan.row.gemm.fp16:
            ctx.kernel("gemm.cu", "gemm_f32a")(grid, (256,), args)
        else:
            ctx.kernel("gemm.cu", "gemm_f32a_split")(grid, (256,), args + (self.range_amax(a),))
        return out

    def choose(self, M, N, K, routes: dict, tag=""):
        """The fastest of ``routes`` (GemmRoute -> run: kernel_select's candidates) for this shape (M rounded up
        to a power of two), timed the first time the shape is seen (best of 5 interleaved runs) and logged; a
        pinned route (``--gemm`` wmma / cublas) is taken as it is. Inside ``gemm_routes()`` the choice is also
        recorded."""
        choices = self.choices
        key = shape_key(M, N, K, tag, self.ctx.plan.path)
        got = choices.pin if choices.pin is not None else choices.chosen.get(key)
        if got is None:
            cp = self.ctx.cp
            times = {name: math.inf for name in routes}
            for fn in routes.values():
                fn()                                   # compile, allocate, warm the clocks
            for _ in range(5):                         # interleaved, best of 5: a clock ramp or a hiccup during
                for name, fn in routes.items():        # one candidate's turn does not decide
                    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                    e0.record()
                    fn()
                    e1.record()
                    e1.synchronize()
                    times[name] = min(times[name], cp.cuda.get_elapsed_time(e0, e1))
            got = min(times, key=times.get)
            choices.chosen[key] = got
            log.info("gemm autotune M~%d N=%d K=%d %s: %s -> %s", key[2], N, K, tag,
                     ", ".join(f"{n} {t:.3f} ms" for n, t in times.items()), got)
        if choices.seen is not None:
            choices.seen[key] = got
        return got

    @contextmanager
    def gemm_routes(self):
        """Yields a dict that fills, while the block runs, with the route each GEMM took: {shape_key: GemmRoute}
        (a pinned ``gemm`` mode included), so a caller can say which of its GEMMs ran on
        cuBLAS. Only GEMMs issued from Python are seen: an eager run or a graph's capture, not a graph's replay.
        Not nested."""
        self.choices.seen = seen = {}
        try:
            yield seen
        finally:
            self.choices.seen = None

    def linear(self, x, w, b=None):
        ctx = self.ctx
        cp = ctx.cp
        if w.dtype != cp.float16:                     # small fp32 matrices (e.g. a [1, F] scorer row)
            # a reduction over broadcast views, not cuBLAS: CuPy's cuBLAS calls refuse a graph capture
            x2 = ctx.f32(x).reshape(-1, x.shape[-1])
            y = rowdot_k()(x2[:, None, :], w[None, :, :], axis=2).reshape(x.shape[:-1] + (w.shape[0],))
            return y if b is None else y + b
        lead = x.shape[:-1]
        # an fp16 x (a producer wrote the GEMM's operand: operand_dtype) goes in as it is
        x = (ctx.half(x) if x.dtype == cp.float16 else ctx.contiguous(x)).reshape(-1, x.shape[-1])
        M, K = x.shape
        N = w.shape[0]
        out = cp.empty((M, N), dtype=cp.float32)
        if M == 0:
            return out.reshape(lead + (N,))
        self.gemm(x, w, out, ctx.contiguous(b) if b is not None else None)
        return out.reshape(lead + (N,))

    def mlp(self, x, w_gate, w_up, w_down):
        """SwiGLU, processed in token blocks so the [T, intermediate] activation stays small (model.backbone
        already hands it blocks of ``token_block`` rows; direct callers get the same bound). The routes of a
        block, chosen by autotune: wmma (SwiGLU fused into the gate/up GEMM's epilogue, then the down GEMM),
        cuBLAS(Lt) for all three GEMMs (split8: the SwiGLU pass also yields the down GEMM's fp8 scale), and on the
        fp16 row of sm_80+ the mma route (one gate/up kernel with SwiGLU in its epilogue, fp16 out, then the down
        GEMM). x may be fp16 (its producer rounded it: ``operand_dtype``); the split
        kernels take it widened back to fp32 (exactly)."""
        ctx = self.ctx
        cp = ctx.cp
        split = ctx.plan.row.gemm.split
        x = ctx.half(x) if x.dtype == cp.float16 and not split else ctx.contiguous(x)
        T, H = x.shape
        I = w_gate.shape[0]
        out = cp.empty((T, w_down.shape[0]), dtype=cp.float32)
        step = ctx.token_block if ctx.token_block > 0 else max(T, 1)
        for t0 in range(0, T, step):
            xb = x[t0:t0 + step]
            M = xb.shape[0]
            ob = out[t0:t0 + M]

            def run_w():
                hb = cp.empty((M, I), dtype=cp.float32 if split else cp.float16)
                grid = (-(-I // 64), -(-M // 128))
                args = (xb, w_gate, w_up, hb, np.int32(M), np.int32(I), np.int32(H))
                if split:
                    ctx.kernel("gemm.cu", "gemm_swiglu_f32a_split")(grid, (256,), args + (self.range_amax(xb),))
                elif xb.dtype == cp.float16:
                    ctx.kernel("gemm.cu", "gemm_swiglu_f16a")(grid, (256,), (ctx.half(xb),) + args[1:])
                else:
                    ctx.kernel("gemm.cu", "gemm_swiglu_f32a")(grid, (256,), args)
                self.gemm(hb, w_down, ob)             # its own autotune (wmma or cuBLAS)

            def run_c():                              # every GEMM on cuBLAS(Lt)
                gb = cp.empty((M, I), dtype=cp.float32)
                ub = cp.empty((M, I), dtype=cp.float32)
                if not split:
                    a16 = ctx.half(xb)
                    self.cublas(a16, w_gate, gb)
                    self.cublas(a16, w_up, ub)
                    del a16
                    hb = cp.empty((M, I), dtype=cp.float16)
                    ctx.kernel("gemm.cu", "swiglu_half")(ctx.grid1(gb.size), (ELEM_THREADS,),
                                                         (gb, ub, hb, np.int64(gb.size)))
                    del gb, ub
                    self.cublas(hb, w_down, ob)
                    return
                if self.has_twin(M, w_gate, w_up):
                    hl, gemm = self.split8(xb), self.split8_gemm
                else:
                    hl, gemm = self.split(xb), self.split_gemm
                gemm(hl, w_gate, gb)
                gemm(hl, w_up, ub)
                del hl
                # gb <- silu(gb) * ub in place; for split8's down GEMM the same pass yields gb's lo amax
                twin = self.has_twin(M, w_down)
                amax = cp.zeros(1, dtype=cp.uint32) if twin else NULL
                ctx.kernel("fp8.cu", "swiglu_inplace")(self.amax_grid(-(-gb.size // 4)), (ELEM_THREADS,),
                                                       (ub, gb, np.int64(gb.size), amax))
                del ub
                if twin:
                    self.split8_gemm(self.split8(gb, amax), w_down, ob)
                else:
                    self.split_gemm(self.split(gb), w_down, ob)

            def run_m():                              # gate, up and SwiGLU in one mma kernel, then down
                hb = self.mma_swiglu(ctx.half(xb), w_gate, w_up, cp.empty((M, I), dtype=cp.float16))
                self.gemm(hb, w_down, ob)             # its own autotune

            runs = {GemmRoute.WMMA: run_w, GemmRoute.CUBLAS: run_c, GemmRoute.MMA: run_m}
            routes = {route: runs[route] for route in kernel_select.swiglu_candidates(ctx.setting, H)}
            routes[self.choose(M, 2 * I, H, routes, "swiglu")]()
        return out

    def bmm(self, a, b):
        """fp32 batched a [h, n, k] @ b [h, k, m] (the head's attention scores and mix, the vision tower's exact
        attention): CuPy's matmul's cuBLAS call made through ctypes, or where cuBLAS cannot be loaded a reduction
        over broadcast views (nothing [h, n, m, k] is materialised): kernel_select.head_products."""
        ctx = self.ctx
        cp = ctx.cp
        if kernel_select.head_products(ctx.setting) is Products.FP32_REDUCTION:
            return rowdot_k()(a[:, :, None, :], b.transpose(0, 2, 1)[:, None, :, :], axis=3)
        # what CuPy's matmul does with these operands: C-contiguous copies where they are views, a fresh output
        a, b = cp.ascontiguousarray(a, dtype=cp.float32), cp.ascontiguousarray(b, dtype=cp.float32)
        h, n, k = a.shape
        out = cp.empty((h, n, b.shape[2]), dtype=cp.float32)
        cublas.gemm_batched_f32(ctx.device.cublas_handle, a.data.ptr, b.data.ptr, out.data.ptr, h, n, k,
                                b.shape[2], cp.cuda.get_current_stream().ptr)
        return out
