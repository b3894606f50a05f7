"""gemm_wgmma.cu (and tile variants appended to it) on this GPU, each checked against an fp32
product of the same fp16 operands (awkward sizes, bias and residual, every output written: C starts as NaN),
then timed against cuBLAS (cupy.matmul, fp16 in and out) and gemm_mma.cu's big tile on the model's shapes.
Needs only cupy and numpy. Usage: check_wgmma.py DIR OUT.json, DIR holding gemm_wgmma.cu, gemm_mma.cu,
and gemm_wgmma.cubin: the sm_90a cubin of gemm_wgmma.cu followed by variants.cu beside this file (other tiles of the
same template, and a warp-specialized form), made offline by the pip NVRTC 12 (compile.Nvrtc().compile(text,
"gemm_wgmma.cu", "sm_90a")). "runtime_build" is gemm_wgmma.cu built by CuPy's NVRTC as compile.load_module
does. Results of the 2026-12-05 H100 run: check-wgmma.json (and .txt) beside this file."""
import json
import sys
import time
from pathlib import Path

import cupy as cp
import numpy as np

DIR, OUT = Path(sys.argv[1]), sys.argv[2]
SHAPES = [(2048, 12288, 4096), (2048, 4096, 12288), (8192, 8192, 4096), (8192, 24576, 4096), (2048, 12352, 4096),
          (346, 12288, 4096), (4096, 1024, 4096), (512, 12288, 4096), (8192, 4096, 12288)]
CHECK = [(M, N, K) for M in (1, 63, 65, 346) for N, K in ((16, 64), (65, 40), (1000, 256), (130, 1000), (129, 8),
                                                        (7, 4104), (300, 520))] + [(129, 257, 64), (1000, 777, 96)]
# kernel -> (block rows, block columns, stages, threads)
WG = {"gemm_wgmma_f16a": (128, 256, 4, 256), "v256x128s4": (256, 128, 4, 256), "v128x128s6": (128, 128, 6, 256),
      "ws128x256s4": (128, 256, 4, 384), "ws256x128s4": (256, 128, 4, 384), "ws128x128s6": (128, 128, 6, 384)}
TOL = 2e-3

rng = cp.random.default_rng(int(time.time()))
out = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "cupy": cp.__version__,
       "nvrtc": list(cp.cuda.nvrtc.getVersion()), "compile": {}, "kernels": {}, "cublas": {}}


def log(*a):
    print(*a, flush=True)


def timeit(f, reps=30):
    for _ in range(3):
        f()
    cp.cuda.Device().synchronize()
    s, e = cp.cuda.Event(), cp.cuda.Event()
    ts = []
    for _ in range(reps):
        s.record()
        f()
        e.record()
        e.synchronize()
        ts.append(cp.cuda.get_elapsed_time(s, e))
    return float(np.median(ts))


src = (DIR / "gemm_wgmma.cu").read_text()
cubin_mod = cp.RawModule(path=str(DIR / "gemm_wgmma.cubin"))
# the run-time route: can CuPy's NVRTC be made to build sm_90a? (CuPy appends its own -arch=sm_90 after ours)
rt_mod = None
for opt in ("-arch=sm_90a", "--gpu-architecture=sm_90a"):
    try:
        m = cp.RawModule(code=src, options=("-std=c++17", opt))
        m.get_function("gemm_wgmma_f16a")
        out["compile"][opt] = "ok"
        rt_mod = rt_mod or m
    except Exception as e:  # noqa: BLE001 - recorded
        out["compile"][opt] = f"{type(e).__name__}: {str(e)[:400]}"
log("compile", out["compile"])
mma_mod = cp.RawModule(code=(DIR / "gemm_mma.cu").read_text(), options=("-std=c++17",))

kernels = {}
for name, (bm, bn, st, th) in WG.items():
    kernels[name] = (cubin_mod.get_function(name), bm, bn, st * (bm + bn) * 128 + 1024, th)
if rt_mod is not None:
    kernels["runtime_build"] = (rt_mod.get_function("gemm_wgmma_f16a"), 128, 256, 4 * 384 * 128 + 1024, 256)
kernels["gemm_mma_f16a_big"] = (mma_mod.get_function("gemm_mma_f16a_big"), 256, 128, 3 * (256 + 128) * 72 * 2,
                                256)
for fn, _, _, smem, _ in kernels.values():
    fn.max_dynamic_shared_size_bytes = smem


def launch(name, a, w, c, bias=None, res=None):
    fn, bm, bn, smem, th = kernels[name]
    M, K = a.shape
    N = w.shape[0]
    fn(((N + bn - 1) // bn, (M + bm - 1) // bm), (th,),
       (a, w, bias if bias is not None else np.uint64(0), res if res is not None else np.uint64(0), c,
        np.int32(M), np.int32(N), np.int32(K)), shared_mem=smem)


def err(c, ref):
    if not bool(cp.isfinite(c).all()):
        return float("nan")
    return float(cp.abs(c - ref).max() / cp.abs(ref).max())


data = {}
for M, N, K in CHECK + SHAPES:
    a = rng.standard_normal((M, K), dtype=cp.float32).astype(cp.float16)
    w = (rng.standard_normal((N, K), dtype=cp.float32) * K ** -0.5).astype(cp.float16)
    data[(M, N, K)] = (a, w, rng.standard_normal(N, dtype=cp.float32), rng.standard_normal((M, N), dtype=cp.float32))

for M, N, K in SHAPES:
    a, w = data[(M, N, K)][:2]
    ms = timeit(lambda: cp.matmul(a, w.T))
    out["cublas"][f"{M}x{N}x{K}"] = {"ms": ms, "tflops": 2 * M * N * K / ms / 1e9}
log("cublas", " ".join(f"{k}:{v['tflops']:.0f}" for k, v in out["cublas"].items()))

# gemm_mma.cu first (the baseline of of_mma), the warp-specialized variants last: a hang there loses only them
for name in sorted(kernels, key=lambda n: (n != "gemm_mma_f16a_big", n.startswith("ws"))):
    rec = out["kernels"][name] = {"check": {}, "shapes": {}}
    worst = 0.0
    for M, N, K in CHECK + SHAPES:
        a, w, b, res = data[(M, N, K)]
        ref = a.astype(cp.float32) @ w.astype(cp.float32).T
        c = cp.full((M, N), np.nan, cp.float32)
        launch(name, a, w, c)
        e1 = err(c, ref)
        c[...] = np.nan
        launch(name, a, w, c, b, res)
        e2 = err(c, ref + b + res)
        rec["check"][f"{M}x{N}x{K}"] = [e1, e2]
        worst = max(worst, e1, e2) if e1 == e1 and e2 == e2 else float("inf")
        del ref, c
    cp.get_default_memory_pool().free_all_blocks()
    rec["worst_err"] = worst
    rec["ok"] = worst <= TOL
    if rec["ok"]:
        for M, N, K in SHAPES:
            a, w = data[(M, N, K)][:2]
            key = f"{M}x{N}x{K}"
            c = cp.empty((M, N), cp.float32)
            t = timeit(lambda: launch(name, a, w, c))
            s = rec["shapes"][key] = {"ms": t, "tflops": 2 * M * N * K / t / 1e9,
                                      "of_cublas": out["cublas"][key]["ms"] / t}
            m = out["kernels"]["gemm_mma_f16a_big"]["shapes"].get(key)
            if m:
                s["of_mma"] = m["ms"] / t
    log(name, "ok" if rec["ok"] else "WRONG", f"worst {worst:.2e}",
        [k for k, v in rec["check"].items() if not (max(v) <= TOL)][:12],
        " ".join(f"{k}:{v['tflops']:.0f}/{v['of_cublas']:.2f}/{v.get('of_mma', 0):.2f}"
                 for k, v in rec["shapes"].items()))
    json.dump(out, open(OUT, "w"), indent=1)
