"""Where one forward's GPU time goes, kernel by kernel: clef-flash's shapes with random weights (as ``clefcore
bench`` makes them), the precision argv[1] (default fast), one prompt of each length in argv[2] (default
346,8192). Each length runs three times first (compilation, GEMM autotune, the graph capture where one fits),
then once under torch's profiler, whose CUPTI trace holds every kernel the process launches, CuPy's and cuBLAS's
included. Writes JSON to argv[3] (default forward-profile.json): per length, the forward's wall time, the sum of
its kernels' device time, and each kernel name's count and total, largest first, with the family it belongs to.

Needs torch (for the profiler only) beside clefcore on a GPU machine."""

import json
import sys
import time
from collections import defaultdict

import cupy as cp
import numpy as np
from torch.profiler import ProfilerActivity, profile

from clefcore.backends.cuda import CudaOps
from clefcore.bench.end_to_end import forward_run
from clefcore.bench.records import record
from clefcore.bench.weights import random_params
from clefcore.config import HeadConfig, TextConfig
from clefcore.synth import PRESETS, config_json

# substrings of a kernel's name -> the part of the forward it belongs to (the first that matches)
FAMILIES = (("gated_delta", "delta rule"), ("gdn", "delta rule"), ("attention", "attention"),
            ("flash", "attention"), ("conv1d", "conv"), ("rmsnorm", "norms"), ("norm", "norms"),
            ("rotary", "rotary"), ("rope", "rotary"), ("gemm", "GEMM"), ("sm90_xmma", "GEMM"),
            ("cutlass", "GEMM"), ("cublas", "GEMM"), ("mma", "GEMM"), ("swiglu", "MLP elementwise"),
            ("sigmoid", "gates"), ("gate", "gates"), ("softmax", "head"), ("head", "head"), ("segment", "head"),
            ("copy", "copies and casts"), ("cast", "copies and casts"), ("half", "copies and casts"),
            ("memset", "copies and casts"), ("fill", "copies and casts"))


def family(name: str) -> str:
    low = name.lower()
    return next((f for key, f in FAMILIES if key in low), "other")


def main():
    prec = sys.argv[1] if len(sys.argv) > 1 else "fast"
    lengths = [int(v) for v in (sys.argv[2] if len(sys.argv) > 2 else "346,8192").split(",")]
    path = sys.argv[3] if len(sys.argv) > 3 else "forward-profile.json"
    ops = CudaOps(0, tables="device", precision=prec)
    cfg = TextConfig.from_dict(config_json("clef-flash", vision=False))
    params = random_params(cp, ops, cfg, HeadConfig(**PRESETS["clef-flash"]["head"]))
    rng = np.random.default_rng(0)
    out = {"device": ops.ctx.device_name, "precision": ops.plan.path, "lengths": {}}
    for T in lengths:
        run = forward_run(ops, params, [record(rng.integers(0, cfg.vocab_size, T))])
        for _ in range(3):
            run()
        cp.cuda.Device().synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            run()
            cp.cuda.Device().synchronize()
            wall = (time.perf_counter() - t0) * 1e3
        per = defaultdict(lambda: [0, 0.0])
        for ev in prof.events():
            if str(ev.device_type).endswith("CUDA"):   # a kernel or copy on the GPU, not a host op
                per[ev.name][0] += 1
                per[ev.name][1] += ev.time_range.elapsed_us() / 1e3
        kernels = sorted(({"name": n[:160], "family": family(n), "count": c, "ms": round(ms, 4)}
                          for n, (c, ms) in per.items()), key=lambda k: -k["ms"])
        fam = defaultdict(float)
        for k in kernels:
            fam[k["family"]] += k["ms"]
        total = sum(k["ms"] for k in kernels)
        out["lengths"][T] = {"wall_ms": round(wall, 3), "kernel_ms": round(total, 3),
                             "families_ms": {f: round(v, 3) for f, v in sorted(fam.items(), key=lambda x: -x[1])},
                             "kernels": kernels}
        print(f"{T} tokens ({ops.plan.path}): wall {wall:.1f} ms, kernels {total:.1f} ms; "
              + ", ".join(f"{f} {v:.1f}" for f, v in sorted(fam.items(), key=lambda x: -x[1])), flush=True)
        json.dump(out, open(path, "w"), indent=1)


if __name__ == "__main__":
    main()
