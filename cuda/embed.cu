// Embedding / LM-head row gather with bf16 -> fp32 widening (exact: bf16 is the top half of fp32).
//
// numpy twins: clefcore/backends/cpu.py::embed and clefcore/backends/cpu.py::gather_rows.
// Tables stay on the host by default: the host gathers the needed bf16 rows, this kernel widens them on
// the device (rows[n, D] uint16 -> out[n, D] fp32). When a table lives on the device, ids index it here.
#include "mma_sm70.cuh"

extern "C" __global__ void widen_bf16(const unsigned short* __restrict__ x, float* __restrict__ y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = bf2f(x[i]);
}

extern "C" __global__ void gather_bf16_rows(const unsigned short* __restrict__ table, const long long* __restrict__ ids,
                                            float* __restrict__ y, int n, int D) {
    const long long total = (long long)n * D;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < total; e += (long long)gridDim.x * blockDim.x) {
        const long long r = e / D;
        const int i = (int)(e % D);
        y[e] = bf2f(table[ids[r] * D + i]);
    }
}

// NaN/Inf/all-zero guard: flags[0] += non-finite count, flags[1] += nonzero count.
// numpy twin: clefcore/backends/cpu.py::check_finite. Counts are reduced in the block first, one atomic per block:
// same-address atomics serialise, and even one per warp (16K per call) cost more than reading the layer.
extern "C" __global__ void finite_check(const float* __restrict__ x, long long n, unsigned long long* __restrict__ flags) {
    unsigned long long bad = 0, nz = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float v = x[i];
        if (!(fabsf(v) <= 3.402823466e38f)) bad++;
        if (v != 0.f) nz++;
    }
    bad = block_reduce(bad, OpAdd());
    nz = block_reduce(nz, OpAdd());
    if (threadIdx.x == 0 && bad) atomicAdd(flags, bad);
    if (threadIdx.x == 0 && nz) atomicAdd(flags + 1, nz);
}
