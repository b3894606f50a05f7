// Row normalisations, one warp per row, fp32 math throughout.
//
// numpy twins: clefcore/backends/cpu.py::rmsnorm (zero-centred, x / rms * (1 + w)),
//              clefcore/backends/cpu.py::add_rmsnorm (residual add fused: s = x + d, y = rmsnorm(s)),
//              clefcore/backends/cpu.py::gated_rmsnorm (x / rms * w * silu(z)),
//              clefcore/backends/cpu.py::layernorm, clefcore/backends/cpu.py::l2norm.
//
// A warp owns a row; lanes stride over it (coalesced), the sum is a shuffle reduction; the second pass
// re-reads the row from L1/L2. Input rows may have a stride (q/k views of a [T, H, 2, D] projection), the
// output is always contiguous [R, D]. Memory-bound: bytes = read(s) + write once.
#include "mma_sm70.cuh"

// the row this warp owns (blockDim.x / 32 rows per block)
__device__ __forceinline__ int warp_row() { return blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); }

// sum of squares of one row, reduced over the warp (every lane gets it)
__device__ __forceinline__ float row_sumsq(const float* __restrict__ xr, int D) {
    float ss = 0.f;
    for (int i = threadIdx.x & 31; i < D; i += 32) { const float v = xr[i]; ss += v * v; }
    return warp_sum(ss);
}

extern "C" __global__ void rmsnorm_rows(const float* __restrict__ x, long long xs, const float* __restrict__ w,
                                        float* __restrict__ y, int R, int D, float eps) {
    const int row = warp_row(), lane = threadIdx.x & 31;
    if (row >= R) return;
    const float* xr = x + (long long)row * xs;
    const float inv = 1.f / sqrtf(row_sumsq(xr, D) / (float)D + eps);
    float* yr = y + (long long)row * D;
    for (int i = lane; i < D; i += 32) yr[i] = xr[i] * inv * (1.f + w[i]);
}

extern "C" __global__ void add_rmsnorm_rows(const float* __restrict__ x, const float* __restrict__ d,
                                            const float* __restrict__ w, float* __restrict__ s,
                                            float* __restrict__ y, int R, int D, float eps) {
    const int row = warp_row(), lane = threadIdx.x & 31;
    if (row >= R) return;
    const long long o = (long long)row * D;
    float ss = 0.f;
    for (int i = lane; i < D; i += 32) { float v = x[o + i] + d[o + i]; s[o + i] = v; ss += v * v; }
    ss = warp_sum(ss);
    const float inv = 1.f / sqrtf(ss / (float)D + eps);
    __syncwarp();
    for (int i = lane; i < D; i += 32) y[o + i] = s[o + i] * inv * (1.f + w[i]);
}

// z row r = head r % zh of token r / zh, token rows zs apart (z may be a column slice of the fused projection)
extern "C" __global__ void gated_rmsnorm_rows(const float* __restrict__ x, long long xs, const float* __restrict__ z,
                                              long long zs, int zh, const float* __restrict__ w,
                                              float* __restrict__ y, int R, int D, float eps) {
    const int row = warp_row(), lane = threadIdx.x & 31;
    if (row >= R) return;
    const float* xr = x + (long long)row * xs;
    const float* zr = z + (long long)(row / zh) * zs + (long long)(row % zh) * D;
    const float inv = 1.f / sqrtf(row_sumsq(xr, D) / (float)D + eps);
    float* yr = y + (long long)row * D;
    for (int i = lane; i < D; i += 32) {
        float zz = zr[i];
        yr[i] = (xr[i] * inv) * w[i] * (zz / (1.f + expf(-zz)));
    }
}

extern "C" __global__ void layernorm_rows(const float* __restrict__ x, long long xs, const float* __restrict__ w,
                                          const float* __restrict__ b, float* __restrict__ y, int R, int D,
                                          float eps) {
    const int row = warp_row(), lane = threadIdx.x & 31;
    if (row >= R) return;
    const float* xr = x + (long long)row * xs;
    float sm = 0.f;
    for (int i = lane; i < D; i += 32) sm += xr[i];
    const float mu = warp_sum(sm) / (float)D;
    float sv = 0.f;
    for (int i = lane; i < D; i += 32) { float c = xr[i] - mu; sv += c * c; }
    const float inv = 1.f / sqrtf(warp_sum(sv) / (float)D + eps);
    float* yr = y + (long long)row * D;
    for (int i = lane; i < D; i += 32) yr[i] = (xr[i] - mu) * inv * w[i] + b[i];
}

extern "C" __global__ void l2norm_rows(const float* __restrict__ x, long long xs, float* __restrict__ y, int R,
                                       int D, float eps, float scale) {
    const int row = warp_row(), lane = threadIdx.x & 31;
    if (row >= R) return;
    const float* xr = x + (long long)row * xs;
    const float f = scale / sqrtf(row_sumsq(xr, D) + eps);
    float* yr = y + (long long)row * D;
    for (int i = lane; i < D; i += 32) yr[i] = xr[i] * f;
}
