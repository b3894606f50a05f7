// Range scaling of the split (exact) path's fp32 operands. fp16 stops at 65504; an activation beyond it would
// enter the tensor cores as Inf. When the range-safe fallback runs (CudaOps.fallback), each split operand x comes
// with amax = max |x| as fp32 bits (gemm.cu abs_amax): beyond fp16's range, x is scaled by 2^-shift on its way
// in and the product by 2^shift on its way out, both exact powers of two.
//
// numpy twin: none of its own; the result is clefcore/backends/cpu.py::linear's product, checked by
// tests/test_kernels.py::test_split_range_scaling.
#pragma once

// amax null (every normal run) or within fp16's range: 0, so the operand converts bit for bit as without it.
// NaN or Inf: 0 as well, so that they reach the output and the guards see them.
__device__ __forceinline__ int range_shift(const unsigned* __restrict__ amax) {
    if (!amax) return 0;
    const float a = __uint_as_float(*amax);
    if (!(a > 65504.f) || a == CLEF_INF) return 0;
    return ilogbf(a) - 14;   // a < 2^(ilogb(a) + 1), so a * 2^-shift < 2^15
}
