"""One delta-rule call at clef-flash's shapes for a profiler: T tokens (argv[1], default 8192) in one sequence,
16 key and 32 value heads of 128, the precision argv[2] (default fast), the kernel switches argv[3] (as
``--kernels``; default none). A warm-up call first (compilation, the workspace), then one call between
cudaProfilerStart and Stop, so that ``ncu --profile-from-start off`` sees exactly one forward's delta-rule kernels.
Prints the call's GPU time (median of 5, events) and the kernels' module."""

import sys

import cupy as cp
import numpy as np

from clefcore.backends.cuda import CudaOps
from clefcore.bench.kernels import gdn_inputs
from clefcore.bench.timing import gpu_ms

T = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
ops = CudaOps(0, precision=sys.argv[2] if len(sys.argv) > 2 else "fast",
              kernels=sys.argv[3] if len(sys.argv) > 3 else None)
args = gdn_inputs(cp, ops, T) + (cp.asarray(np.array([0, T], np.int32)),)
ms = gpu_ms(cp, lambda: ops.gated_delta_rule(*args))
print(f"gated delta rule T={T} {ops.plan.path}: {ms:.3f} ms ({ops.gdn_kernels().module})")
cp.cuda.Device().synchronize()
cp.cuda.profiler.start()
ops.gated_delta_rule(*args)
cp.cuda.Device().synchronize()
cp.cuda.profiler.stop()
