"""On a GPU: how far the fast plan's delta rule (gated_delta_fast.cu) lands from the fp32 numpy reference, in its
output and in the final state it carries, over many seeded draws, with the state recurrence in one fp16 pass
(the default then) and in three (the gdn_split_scan switch of 29faa7f-578242b, since removed). The draws are those of
tests/test_kernels.py (_gdn_inputs, _state0), so a seed reproduces a draw on the CPU too.

Run with clefcore installed: python docs/studies/gdn_fast_state.py OUT.json [draws]. Writes the JSON as it goes:
per case and variant, every draw's (seed, output error, state error), errors as max |got - ref| / max |ref|."""
import json
import sys
import time

import numpy as np

from clefcore.backends import cpu
from clefcore.backends.cuda import CudaOps

CASES = {"cu1-128": ([0, 63], 1, 2, 128, 128), "cu300-128": ([0, 300], 1, 2, 128, 128),
         "packed-128": ([0, 1, 64, 129, 259], 1, 2, 128, 128), "model-2048": ([0, 2048], 16, 32, 128, 128)}


def draw(seed, T, hk, hv, dk, dv, B):
    rng = np.random.default_rng(seed)

    def r(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)
    q = cpu.l2norm(r(T, hk, dk), 1e-6, dk ** -0.5)
    k = cpu.l2norm(r(T, hk, dk), 1e-6)
    v = r(T, hv, dv)
    g, beta = cpu.gdn_gates(r(T, hv), r(T, hv), r(hv, scale=0.5), r(hv))
    return q, k, v, g, beta, r(B, hv, dk, dv, scale=0.5)


def rel(got, ref):
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / np.max(np.abs(ref)))


def main(path, draws):
    out = {"draws": draws, "cases": {}}
    variants = {"one-pass": CudaOps(0, precision="fast", kernels="gdn_split_scan=off"),
                "split-scan": CudaOps(0, precision="fast", kernels="gdn_split_scan")}
    out["device"] = variants["one-pass"].device_name
    for name, (cu, hk, hv, dk, dv) in CASES.items():
        n = draws if cu[-1] < 1000 else max(draws // 10, 3)
        res = {v: [] for v in variants}
        t0 = time.time()
        for seed in range(n):
            q, k, v_, g, beta, S0 = draw(seed, cu[-1], hk, hv, dk, dv, len(cu) - 1)
            S_ref = S0.copy()
            ref = cpu.gated_delta_rule(q, k, v_, g, beta, np.array(cu), S_ref)
            for vname, ops in variants.items():
                S = ops.asarray(S0)
                got = ops.gated_delta_rule(*(ops.asarray(a) for a in (q, k, v_, g, beta)), np.array(cu), S)
                res[vname].append((seed, rel(ops.to_host(got), ref), rel(ops.to_host(S), S_ref)))
        summary = {}
        for vname, rows in res.items():
            o = np.array([x[1] for x in rows])
            s = np.array([x[2] for x in rows])
            summary[vname] = dict(out_median=float(np.median(o)), out_max=float(o.max()),
                                  state_median=float(np.median(s)), state_p90=float(np.quantile(s, 0.9)),
                                  state_max=float(s.max()), draws=rows)
            print(f"{name} {vname}: out median {np.median(o):.2e} max {o.max():.2e}; state median {np.median(s):.2e}"
                  f" p90 {np.quantile(s, 0.9):.2e} max {s.max():.2e} ({len(rows)} draws, {time.time() - t0:.0f} s)",
                  flush=True)
        out["cases"][name] = summary
        with open(path, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 300)
