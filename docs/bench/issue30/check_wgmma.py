"""Issue 30 item 4: gemm_wgmma.cu (and tile variants appended to it) on this GPU, each checked against an fp32
product of the same fp16 operands (awkward sizes, bias and residual, every output written: C starts as NaN),
then timed against cuBLAS (cupy.matmul, fp16 in and out) and gemm_mma.cu's big tile on the model's shapes.
Needs only cupy and numpy. Usage: check_wgmma.py DIR OUT.json, DIR holding gemm_wgmma.cu, gemm_mma.cu,
variants.cu (other tiles of the same template) and gemm_wgmma.cubin, the sm_90a cubin of the first plus the
third made offline by the pip NVRTC 12 (clefcore.backends.cuda.compile.Nvrtc)."""
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
# kernel -> (block rows, block columns, stages)
WG = {"gemm_wgmma_f16a": (128, 256, 4), "v256x128s4": (256, 128, 4), "v128x128s6": (128, 128, 6)}
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
for name, (bm, bn, st) in WG.items():
    kernels[name] = (cubin_mod.get_function(name), bm, bn, st * (bm + bn) * 128 + 1024)
if rt_mod is not None:
    kernels["runtime_build"] = (rt_mod.get_function("gemm_wgmma_f16a"), 128, 256, 4 * 384 * 128 + 1024)
kernels["gemm_mma_f16a_big"] = (mma_mod.get_function("gemm_mma_f16a_big"), 256, 128, 3 * (256 + 128) * 72 * 2)
for fn, _, _, smem in kernels.values():
    fn.max_dynamic_shared_size_bytes = smem


def launch(name, a, w, c, bias=None, res=None):
    fn, bm, bn, smem = kernels[name]
    M, K = a.shape
    N = w.shape[0]
    fn(((N + bn - 1) // bn, (M + bm - 1) // bm), (256,),
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

for name in kernels:
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
    rec["worst_err"] = worst
    rec["ok"] = worst <= TOL
    log(name, "ok" if rec["ok"] else "WRONG", f"worst {worst:.2e}",
        [k for k, v in rec["check"].items() if not (max(v) <= TOL)][:12])
    json.dump(out, open(OUT, "w"), indent=1)
cp.get_default_memory_pool().free_all_blocks()

for M, N, K in SHAPES:
    a, w, b, res = data[(M, N, K)]
    key = f"{M}x{N}x{K}"
    ms = timeit(lambda: cp.matmul(a, w.T))
    out["cublas"][key] = {"ms": ms, "tflops": 2 * M * N * K / ms / 1e9}
    c = cp.empty((M, N), cp.float32)
    row = [f"{key:>18} cublas {2 * M * N * K / ms / 1e9:5.0f}"]
    for name in kernels:
        rec = out["kernels"][name]
        if not rec["ok"]:
            continue
        t = timeit(lambda: launch(name, a, w, c))
        rec["shapes"][key] = {"ms": t, "tflops": 2 * M * N * K / t / 1e9, "of_cublas": ms / t}
        row.append(f"{name} {2 * M * N * K / t / 1e9:5.0f} ({ms / t:.2f})")
    for name in kernels:
        s = out["kernels"][name]["shapes"].get(key)
        m = out["kernels"]["gemm_mma_f16a_big"]["shapes"].get(key)
        if s and m:
            s["of_mma"] = m["ms"] / s["ms"]
    log(" | ".join(row))
    json.dump(out, open(OUT, "w"), indent=1)
json.dump(out, open(OUT, "w"), indent=1)
