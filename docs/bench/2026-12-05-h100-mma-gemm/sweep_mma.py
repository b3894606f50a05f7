"""gemm_mma.cu's tile sweep: each tile of the file's template, instantiated here as a kernel of its
own, is checked against an fp32 product on awkward and model shapes first, then timed against cuBLAS
(cupy.matmul, fp16 out) on the model's shapes. Run on an sm_80+ GPU from the repository root:
    python3 docs/bench/2026-12-05-h100-mma-gemm/sweep_mma.py out.json
Its H100 run is sweep-mma.json beside this file (run when the tile was set by
macros; the template computes the same kernel)."""
import json, sys, time
import numpy as np
import cupy as cp

src = open("cuda/gemm_mma.cu").read()
V = {"A": (128,128,32,3,2,4), "B": (128,128,32,4,2,4), "C": (128,128,64,3,2,4), "D": (128,256,32,3,2,4),
     "E": (128,256,64,3,2,4), "F": (256,128,32,3,4,2), "G": (128,128,32,4,2,2), "H": (128,256,32,4,2,4),
     "I": (128,128,64,4,2,2), "J": (256,128,64,3,4,2), "K": (128,256,32,5,2,4), "L": (128,128,32,5,2,4)}
SHAPES = [(8192, 8192, 4096), (2048, 12352, 4096), (2048, 4096, 12288), (2048, 24576, 4096),
          (8192, 24576, 4096), (8192, 4096, 12288), (346, 12288, 4096), (4096, 1024, 4096)]
CHECK = [(65, 144, 264), (300, 520, 1000), (1, 48, 512), (129, 257, 64)]

def timeit(f, reps=20):
    f(); cp.cuda.Device().synchronize()
    s, e = cp.cuda.Event(), cp.cuda.Event()
    ts = []
    for _ in range(reps):
        s.record(); f(); e.record(); e.synchronize()
        ts.append(cp.cuda.get_elapsed_time(s, e))
    return float(np.median(ts))

rng = cp.random.default_rng(0)
out = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "variants": {}, "cublas": {}}
data = {}
for M, N, K in SHAPES + CHECK:
    a = (rng.standard_normal((M, K), dtype=cp.float32)).astype(cp.float16)
    w = (rng.standard_normal((N, K), dtype=cp.float32) * 0.05).astype(cp.float16)
    data[(M, N, K)] = (a, w)
for M, N, K in SHAPES:
    a, w = data[(M, N, K)]
    ms = timeit(lambda: cp.matmul(a, w.T))
    out["cublas"][f"{M}x{N}x{K}"] = {"ms": ms, "tflops": 2 * M * N * K / ms / 1e9}
    print("cublas", M, N, K, f"{ms:.3f} ms {2*M*N*K/ms/1e9:.0f} TFLOP/s", flush=True)
for name, (bm, bn, bk, st, wm, wn) in V.items():
    tile = (f'extern "C" __global__ void __launch_bounds__({wm * wn * 32}) sweep_tile(const mg_half* A, '
            f'const mg_half* W, const float* bias, const float* res, float* C, int M, int N, int K) '
            f'{{ mg_gemm<{bm}, {bn}, {bk}, {st}, {wm}, {wn}>(A, W, bias, res, C, M, N, K); }}\n')
    smem = st * (bm + bn) * (bk + 8) * 2
    threads = wm * wn * 32
    t0 = time.time()
    fn = cp.RawModule(code=src + tile, options=("--std=c++17",)).get_function("sweep_tile")
    fn.max_dynamic_shared_size_bytes = smem
    rec = {"tile": [bm, bn, bk, st, wm, wn], "smem": smem, "threads": threads,
           "compile_s": round(time.time() - t0, 1), "check": {}, "shapes": {}}
    def run(a, w, c, M, N, K):
        null = np.uint64(0)
        fn(((N + bn - 1) // bn, (M + bm - 1) // bm), (threads,),
           (a, w, null, null, c, np.int32(M), np.int32(N), np.int32(K)), shared_mem=smem)
    ok = True
    for M, N, K in CHECK + SHAPES[:2]:
        a, w = data[(M, N, K)]
        c = cp.empty((M, N), cp.float32)
        run(a, w, c, M, N, K)
        ref = a.astype(cp.float32) @ w.astype(cp.float32).T
        err = float(cp.abs(c - ref).max() / cp.abs(ref).max())
        rec["check"][f"{M}x{N}x{K}"] = err
        ok &= err < 2e-3
    rec["ok"] = ok
    if ok:
        for M, N, K in SHAPES:
            a, w = data[(M, N, K)]
            c = cp.empty((M, N), cp.float32)
            ms = timeit(lambda: run(a, w, c, M, N, K))
            cb = out["cublas"][f"{M}x{N}x{K}"]["ms"]
            rec["shapes"][f"{M}x{N}x{K}"] = {"ms": ms, "tflops": 2 * M * N * K / ms / 1e9, "of_cublas": cb / ms}
    out["variants"][name] = rec
    print(name, rec["tile"], "ok" if ok else f"WRONG {rec['check']}",
          " ".join(f"{k}:{v['of_cublas']:.2f}" for k, v in rec["shapes"].items()), flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
