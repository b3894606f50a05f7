"""``clefcore bench``'s kernel table: per-kernel GPU times, with achieved rates next to ceilings measured in the
same run (a device-to-device copy, cuBLAS's fp16 GEMM). Every op is checked against the numpy backend before
it is timed, so that a wrong kernel is never reported as a fast one. The GEMM rows name their route
(``CudaOps.gemm_with``) and set the precision plan they run under (``CudaOps.plan``); nothing else of the
backend is reached past its public methods and its device context (``CudaOps.ctx``)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..kernel_select import GemmRoute, mma_tile
from .timing import gpu_ms, graph_ms

GEMM_SHAPES = ((2048, 12288, 4096), (2048, 4096, 12288), (346, 12288, 4096), (8192, 8192, 4096))
HEAD_GEMM = (11, 4096, 1024)          # a joint-head GEMM: one row per option
SEQ_LENS = (2048, 8192)
# max |got - ref| / max |ref| allowed when a timed op is checked against numpy (the kernel tests' bounds)
TOL_FP16, TOL_SPLIT, TOL_SPLIT8, TOL_FP32 = 4e-3, 2e-5, 5e-5, 1e-5
# the delta rule: fast (gated_delta_wy_fast.cu: the output's products in one fp16 pass), else every product in three
TOL_GDN_FAST, TOL_GDN = 2e-3, 2e-4


GDN_HEADS = (16, 32, 128, 128)       # clef-flash's Gated DeltaNet: key heads, value heads, key and value dims


def gdn_inputs(cp, ops, T):
    """The delta rule's (q, k, v, g, beta) for one T-token sequence at clef-flash's head shapes, of the model's
    kind: q and k L2-normalised (q scaled), the gates from random projections through the backend's gate op."""
    hk, hv, dk, dv = GDN_HEADS
    q = ops.l2norm(cp.random.standard_normal((T, hk, dk), dtype=cp.float32), 1e-6, dk ** -0.5)
    k = ops.l2norm(cp.random.standard_normal((T, hk, dk), dtype=cp.float32), 1e-6)
    v = cp.random.standard_normal((T, hv, dv), dtype=cp.float32)
    g, beta = ops.gdn_gates(cp.random.standard_normal((T, hv), dtype=cp.float32),
                            cp.random.standard_normal((T, hv), dtype=cp.float32),
                            cp.zeros(hv, cp.float32), cp.zeros(hv, cp.float32))
    return q, k, v, g, beta


def tol_k(tol, K):
    """A split / split8 bound for a GEMM over K terms: their error is the fp32 accumulation's, which grows
    linearly with K because the tensor cores add with truncation (a numpy emulation, one truncating add per
    16-term k-step: 2.0e-6 / 6.6e-6 / 2.2e-5 at K = 1024 / 4096 / 12,288; wmma split measured 2.8e-5 at
    12,288 on the H200). The bounds above hold up to K = 4096. fp16 operands' error is their rounding, not the
    sum's: no scaling there."""
    return tol * max(1.0, K / 4096)


def _copy_rate(cp):
    """device-to-device copy of 1 GiB: (ms, GB/s), the bandwidth ceiling"""
    a = cp.random.standard_normal(1 << 28, dtype=cp.float32)
    b = cp.empty_like(a)
    t = gpu_ms(cp, lambda: b.__setitem__(slice(None), a))
    return t, 2 * a.nbytes / t / 1e6


def _check(name, got, ref, tol, checks):
    """``got`` (host array) against the numpy ``ref`` before ``name`` is timed: a wrong kernel must not be
    reported as a fast one. Raises DeviceError beyond ``tol``; the error is kept for the JSON."""
    from ..errors import DeviceError
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    err = float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), 1e-30))
    if not np.isfinite(err) or err > tol:
        raise DeviceError(f"bench check: {name}: max |got - ref| / max |ref| = {err:.3e} against numpy, "
                          f"more than {tol:.0e}; nothing is timed")
    checks[name] = err


def table(cp, ops, out, gemm_shapes=GEMM_SHAPES, head_gemm=HEAD_GEMM, seq_lens=SEQ_LENS):
    """Per-kernel times with achieved rates next to the ceilings measured here. Each op runs once first and its
    output is checked against the numpy path (GEMMs on a few rows, attention on the last queries, the other
    ops whole); the errors go to ``out["checks"]``. Where cuBLAS cannot be loaded its rows (the GEMM ceilings,
    split, split8) are left out, said in ``out["kernels_note"]``, and clefcore's GEMMs are given in TFLOP/s alone."""
    from ..backends import cpu
    rows, checks = [], {}
    cublas = ops.ctx.cublas_missing is None
    if not cublas:
        out["kernels_note"] = f"no cuBLAS rows: cuBLAS cannot be loaded ({ops.ctx.cublas_missing})"
        print(f"  {out['kernels_note']}")
    host = ops.to_host
    plan = ops.plan               # the plan CudaOps resolved; the wmma rows below switch its path and restore it
    t, copy_gbs = _copy_rate(cp)
    rows.append(("d2d copy (ceiling)", t, f"{copy_gbs:.0f} GB/s"))

    def gemm_ref(x, w):
        """rows checked of a GEMM x @ w.T (its first, middle and last) and their float64 numpy values"""
        idx = sorted({0, x.shape[0] // 2, x.shape[0] - 1})
        return idx, host(x[idx]).astype(np.float64) @ host(w).astype(np.float64).T

    def gemm(name, route, x, w, o, ref, tol, timer=gpu_ms, **kw):
        """o = x @ w.T by ``route``: run once, its rows checked against ref, then timed"""
        def fn():
            ops.gemm_with(route, x, w, o)
        fn()
        _check(name, host(o[ref[0]]), ref[1], tol, checks)
        return timer(cp, fn, **kw)

    for M, N, K in gemm_shapes:
        x = cp.random.standard_normal((M, K), dtype=cp.float32)
        w = (cp.random.standard_normal((N, K), dtype=cp.float32) * 0.02).astype(cp.float16)
        o = cp.empty((M, N), cp.float32)
        fl = 2.0 * M * N * K
        x16 = x.astype(cp.float16)            # the cublas route's fp16 operand, made once: not timed
        ref = gemm_ref(x, w)
        tc = None                                             # the cuBLAS fp16 ceiling, where cuBLAS loads
        if cublas:
            tc = gemm(f"cuBLAS fp16 {M}x{N}x{K}", GemmRoute.CUBLAS, x16, w, o, ref, TOL_FP16, inner=10)
            rows.append((f"cuBLAS fp16 GEMM {M}x{N}x{K} (ceiling)", tc, f"{fl / tc / 1e9:.0f} TFLOP/s"))
            ts = gemm(f"cuBLAS split {M}x{N}x{K}", GemmRoute.SPLIT, x, w, o, ref, tol_k(TOL_SPLIT, K), inner=10)
            rows.append((f"cuBLAS split GEMM {M}x{N}x{K} (2 passes, incl. split)", ts,
                         f"{tc / ts:.0%} of one fp16 pass"))
            ops.plan = plan
            if plan.row.gemm.fp8_lo and ops.twins.cover(M, ops.twin(w)):
                t8 = gemm(f"cuBLAS(Lt) split8 {M}x{N}x{K}", GemmRoute.SPLIT8, x, w, o, ref, tol_k(TOL_SPLIT8, K),
                          inner=10)
                rows.append((f"cuBLAS(Lt) split8 GEMM {M}x{N}x{K} (incl. split)", t8,
                             f"{tc / t8:.0%} of one fp16 pass, {ts / t8:.2f}x split"))
            ops.twins.drop(w)

        def rate(t):                                          # clefcore's own kernels' rows
            return f"{fl / t / 1e9:.0f} TFLOP/s" + ("" if tc is None else f" ({tc / t:.0%} of cuBLAS)")
        for path in ("fp16", "split"):
            ops.plan = replace(plan, path=path)
            tw = gemm(f"wmma {path} {M}x{N}x{K}", GemmRoute.WMMA, x, w, o, ref,
                      TOL_FP16 if ops.plan.row.gemm.fp16 else tol_k(TOL_SPLIT, K), inner=10)
            rows.append((f"wmma GEMM {path} {M}x{N}x{K}", tw, rate(tw)))
        ops.plan = plan
        if mma_tile(ops.ctx.caps) is not None and K % 8 == 0:   # sm_80+: on the fp16 operand, as cuBLAS's ceiling
            tm = gemm(f"mma fp16 {M}x{N}x{K}", GemmRoute.MMA, x16, w, o, ref, TOL_FP16, inner=10)
            rows.append((f"mma GEMM fp16 {M}x{N}x{K} (fp16 operand)", tm, rate(tm)))
    M, N, K = head_gemm
    x = cp.random.standard_normal((M, K), dtype=cp.float32)
    w = (cp.random.standard_normal((N, K), dtype=cp.float32) * 0.02).astype(cp.float16)
    o = cp.empty((M, N), cp.float32)
    ref = gemm_ref(x, w)
    tr = gemm(f"gemm_rows {M}x{N}x{K}", GemmRoute.ROWS, x, w, o, ref, TOL_FP32, timer=graph_ms)
    tw = gemm(f"wmma {plan.path} {M}x{N}x{K}", GemmRoute.WMMA, x, w, o, ref,
              TOL_FP16 if plan.row.gemm.fp16 else tol_k(TOL_SPLIT, K), timer=graph_ms)
    rows.append((f"gemm_rows {M}x{N}x{K} (fp32 CUDA cores; CUDA graph)", tr,
                 f"{w.nbytes / tr / 1e6:.0f} GB/s of weight ({w.nbytes / tr / 1e6 / copy_gbs:.0%} of copy)"))
    if cublas:
        ts = gemm(f"cuBLAS split {M}x{N}x{K}", GemmRoute.SPLIT, x, w, o, ref, tol_k(TOL_SPLIT, K), inner=10)
        # cuBLAS via CuPy: not capturable
        rows.append((f"wmma {plan.path}, same shape (graph) / cuBLAS split (queued)", tw,
                     f"cuBLAS split {ts:.3f} ms; gemm_rows {tw / tr:.1f}x / {ts / tr:.1f}x faster"))
    else:
        rows.append((f"wmma {plan.path}, same shape (graph)", tw, f"gemm_rows {tw / tr:.1f}x faster"))
    for T in seq_lens:
        cu = np.array([0, T])
        D, hq, hkv = 256, 16, 4
        # as the engine calls it: fp32 q, K and V from the fp16 cache; 10 calls queued per event pair so that
        # the host's tile list is not GPU time
        q = cp.random.standard_normal((T, hq, D), dtype=cp.float32)
        k = cp.random.standard_normal((T, hkv, D), dtype=cp.float32).astype(cp.float16)
        v = cp.random.standard_normal((T, hkv, D), dtype=cp.float32).astype(cp.float16)
        last = min(T, 8)                                      # the queries that see the most keys
        _check(f"attention T={T}", host(ops.attention(q, k, v, cu, 1 / 16))[T - last:],
               cpu.attention(host(q[T - last:]), host(k), host(v), cu, 1 / 16, q_offset=T - last), TOL_FP16, checks)
        ta = gpu_ms(cp, lambda: ops.attention(q, k, v, cu, 1 / 16), inner=10)
        fl = 4.0 * hq * D * T * T / 2
        rows.append((f"attention T={T} D={D} 16q/4kv (fp32 q cast to fp16, fp16 K/V cache)", ta,
                     f"{fl / ta / 1e9:.0f} TFLOP/s"))
        hv = GDN_HEADS[1]
        gdn_args = gdn_inputs(cp, ops, T) + (cu,)
        rule = ops.gdn_kernels()
        one_pass = rule.passes == 1
        _check(f"gated delta rule T={T}", host(ops.gated_delta_rule(*gdn_args)),
               cpu.gated_delta_rule(*map(host, gdn_args[:5]), cu), TOL_GDN_FAST if one_pass else TOL_GDN, checks)
        tg = gpu_ms(cp, lambda: ops.gated_delta_rule(*gdn_args))
        fl = T * hv * 0.18e6
        rows.append((f"gated delta rule T={T} 16k/32v heads d=128", tg,
                     f"{fl / tg / 1e9:.1f} TFLOP/s ({rule.module}: "
                     f"{'products in one fp16 pass' if one_pass else 'fp16 hi+lo passes'})"))
        x = cp.random.standard_normal((T, 4096), dtype=cp.float32)
        w = cp.random.standard_normal(4096, dtype=cp.float32)
        s, y = ops.add_rmsnorm(x, x, w, 1e-6)
        _check(f"add_rmsnorm T={T}", np.concatenate([host(s), host(y)]),
               np.concatenate(cpu.add_rmsnorm(host(x), host(x), host(w), 1e-6)), 2e-5, checks)
        tr = gpu_ms(cp, lambda: ops.add_rmsnorm(x, x, w, 1e-6))
        rows.append((f"add_rmsnorm T={T} H=4096", tr, f"{4 * x.nbytes / tr / 1e6:.0f} GB/s"))
        xc = cp.random.standard_normal((T, 8192), dtype=cp.float32)
        wc = cp.random.standard_normal((8192, 4), dtype=cp.float32)
        _check(f"conv1d+silu T={T}", host(ops.conv1d_silu(xc, wc, cu)), cpu.conv1d_silu(host(xc), host(wc), cu),
               TOL_FP32, checks)
        tcv = gpu_ms(cp, lambda: ops.conv1d_silu(xc, wc, cu))
        rows.append((f"conv1d+silu T={T} C=8192", tcv, f"{2 * xc.nbytes / tcv / 1e6:.0f} GB/s"))
    out["kernels"] = [dict(name=r[0], ms=r[1], rate=r[2]) for r in rows]
    out["checks"] = checks
    for r in rows:
        print(f"  {r[0]:55s} {r[1]:9.3f} ms  {r[2]}")
    print(f"  every timed op matched numpy first ({len(checks)} checks; each op's relative error is in the JSON's "
          f"\"checks\")")
    return rows
