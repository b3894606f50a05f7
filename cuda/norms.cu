// Row normalisations, one thread group (a warp, or a block for wide rows) per row, fp32 math throughout.
//
// numpy twins: clefcore/backends/cpu.py::rmsnorm (zero-centred, x / rms * (1 + w)),
//              clefcore/backends/cpu.py::add_rmsnorm (residual add fused: s = x + d, y = rmsnorm(s)),
//              clefcore/backends/cpu.py::gated_rmsnorm (x / rms * w * silu(z)),
//              clefcore/backends/cpu.py::layernorm, clefcore/backends/cpu.py::l2norm.
//
// A row belongs to a group of G threads, chosen by the host per launch: G = 32 (a warp; narrow rows,
// 8 rows per 256-thread block) or G = 256 (one block per wide row: a warp per 4096-wide row left the
// GPU a quarter occupied at 2048 rows and reached a third of the copy rate). The group's lanes stride over
// the row (coalesced); sums are shuffle reductions, across the block's warps through shared memory; the
// second pass re-reads the row from L1/L2. Input rows follow a row map (xs, xh, xhs): row r starts at
// (r / xh) * xs + (r % xh) * xhs, so one uniform stride (xh = 1: q/k views of a [T, H, 2, D] projection) or a
// token stride and a head stride (the q/k column slices of the conv output viewed [T, H, D]) are read in
// place; the output is always contiguous [R, D]. Memory-bound: bytes = read(s) + write once.
//
// The RMSNorms also come as *_h kernels that write y in fp16: the next weight GEMM's operand under the
// fused_elementwise switch (clefcore/backends/cuda/norms.py). Same template, same fp32 arithmetic; only the
// store rounds (put_y: cvt.rn, as gemm.cu's to_half would after an fp32 store), so y_h = fp16(y) bit for bit.
#include "mma_sm70.cuh"

// Each kernel's body is a template on G (compile-time divisions) and on y's type; the entry point picks G = 32
// or 256.
#define NORM_ENTRY(name, body, params, args) \
    extern "C" __global__ void __launch_bounds__(256) name params { \
        if (G == 32) body<32> args; else body<256> args; \
    }

__device__ __forceinline__ void put_y(float* __restrict__ y, long long i, float v) { y[i] = v; }
__device__ __forceinline__ void put_y(half_t* __restrict__ y, long long i, float v) { y[i] = f2h(v); }

#define ROW_MAP const float* __restrict__ x, long long xs, int xh, long long xhs   // an input with a row map
__device__ __forceinline__ const float* map_row(ROW_MAP, int row) {
    return x + (long long)(row / xh) * xs + (long long)(row % xh) * xhs;
}

template <int G> __device__ __forceinline__ int group_row() { return blockIdx.x * (256 / G) + threadIdx.x / G; }

// the sum of v over the row's group (every thread gets it, in the same order)
template <int G>
__device__ __forceinline__ float group_sum(float v) {
    __shared__ float part[G / 32];
    v = warp_reduce(v, OpAdd());
    if (G == 32) return v;
    __syncthreads();                             // a previous group_sum may still read part[]
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < G / 32; ++i) t += part[i];
    return t;
}

// sum of squares of one row over its group
template <int G>
__device__ __forceinline__ float row_sumsq(const float* __restrict__ xr, int D) {
    float ss = 0.f;
    for (int i = threadIdx.x % G; i < D; i += G) { const float v = xr[i]; ss += v * v; }
    return group_sum<G>(ss);
}

template <int G, typename T>
__device__ __forceinline__ void rmsnorm_rows_g(ROW_MAP, const float* __restrict__ w, T* __restrict__ y, int R, int D,
                                               float eps) {
    const int row = group_row<G>(), lane = threadIdx.x % G;
    if (row >= R) return;
    const float* xr = map_row(x, xs, xh, xhs, row);
    const float inv = 1.f / sqrtf(row_sumsq<G>(xr, D) / (float)D + eps);
    T* yr = y + (long long)row * D;
    for (int i = lane; i < D; i += G) put_y(yr, i, xr[i] * inv * (1.f + w[i]));
}
NORM_ENTRY(rmsnorm_rows, rmsnorm_rows_g, (ROW_MAP, const float* __restrict__ w, float* __restrict__ y, int R, int D,
                                          int G, float eps),
           (x, xs, xh, xhs, w, y, R, D, eps))
NORM_ENTRY(rmsnorm_rows_h, rmsnorm_rows_g, (ROW_MAP, const float* __restrict__ w, half_t* __restrict__ y, int R,
                                            int D, int G, float eps),
           (x, xs, xh, xhs, w, y, R, D, eps))

template <int G, typename T>
__device__ __forceinline__ void add_rmsnorm_rows_g(const float* __restrict__ x, const float* __restrict__ d,
                                                   const float* __restrict__ w, float* __restrict__ s,
                                                   T* __restrict__ y, int R, int D, float eps) {
    const int row = group_row<G>(), lane = threadIdx.x % G;
    if (row >= R) return;
    const long long o = (long long)row * D;
    float ss = 0.f;
    for (int i = lane; i < D; i += G) { float v = x[o + i] + d[o + i]; s[o + i] = v; ss += v * v; }
    const float inv = 1.f / sqrtf(group_sum<G>(ss) / (float)D + eps);
    for (int i = lane; i < D; i += G) put_y(y, o + i, s[o + i] * inv * (1.f + w[i]));
}
NORM_ENTRY(add_rmsnorm_rows, add_rmsnorm_rows_g, (const float* __restrict__ x, const float* __restrict__ d,
                                                  const float* __restrict__ w, float* __restrict__ s,
                                                  float* __restrict__ y, int R, int D, int G, float eps),
           (x, d, w, s, y, R, D, eps))
NORM_ENTRY(add_rmsnorm_rows_h, add_rmsnorm_rows_g, (const float* __restrict__ x, const float* __restrict__ d,
                                                    const float* __restrict__ w, float* __restrict__ s,
                                                    half_t* __restrict__ y, int R, int D, int G, float eps),
           (x, d, w, s, y, R, D, eps))

// z follows its own row map (zs, zh, zhs): a per-head view of the GDN's fused projection is read in place
template <int G, typename T>
__device__ __forceinline__ void gated_rmsnorm_rows_g(ROW_MAP, const float* __restrict__ z, long long zs, int zh,
                                                     long long zhs, const float* __restrict__ w,
                                                     T* __restrict__ y, int R, int D, float eps) {
    const int row = group_row<G>(), lane = threadIdx.x % G;
    if (row >= R) return;
    const float* xr = map_row(x, xs, xh, xhs, row);
    const float* zr = map_row(z, zs, zh, zhs, row);
    const float inv = 1.f / sqrtf(row_sumsq<G>(xr, D) / (float)D + eps);
    T* yr = y + (long long)row * D;
    for (int i = lane; i < D; i += G) {
        float zz = zr[i];
        put_y(yr, i, (xr[i] * inv) * w[i] * (zz / (1.f + expf(-zz))));
    }
}
NORM_ENTRY(gated_rmsnorm_rows, gated_rmsnorm_rows_g, (ROW_MAP, const float* __restrict__ z, long long zs, int zh,
                                                      long long zhs, const float* __restrict__ w,
                                                      float* __restrict__ y, int R, int D, int G, float eps),
           (x, xs, xh, xhs, z, zs, zh, zhs, w, y, R, D, eps))
NORM_ENTRY(gated_rmsnorm_rows_h, gated_rmsnorm_rows_g, (ROW_MAP, const float* __restrict__ z, long long zs, int zh,
                                                        long long zhs, const float* __restrict__ w,
                                                        half_t* __restrict__ y, int R, int D, int G, float eps),
           (x, xs, xh, xhs, z, zs, zh, zhs, w, y, R, D, eps))

template <int G>
__device__ __forceinline__ void layernorm_rows_g(ROW_MAP, const float* __restrict__ w, const float* __restrict__ b,
                                                 float* __restrict__ y, int R, int D, float eps) {
    const int row = group_row<G>(), lane = threadIdx.x % G;
    if (row >= R) return;
    const float* xr = map_row(x, xs, xh, xhs, row);
    float sm = 0.f;
    for (int i = lane; i < D; i += G) sm += xr[i];
    const float mu = group_sum<G>(sm) / (float)D;
    float sv = 0.f;
    for (int i = lane; i < D; i += G) { float c = xr[i] - mu; sv += c * c; }
    const float inv = 1.f / sqrtf(group_sum<G>(sv) / (float)D + eps);
    float* yr = y + (long long)row * D;
    for (int i = lane; i < D; i += G) yr[i] = (xr[i] - mu) * inv * w[i] + b[i];
}
NORM_ENTRY(layernorm_rows, layernorm_rows_g, (ROW_MAP, const float* __restrict__ w, const float* __restrict__ b,
                                              float* __restrict__ y, int R, int D, int G, float eps),
           (x, xs, xh, xhs, w, b, y, R, D, eps))

template <int G>
__device__ __forceinline__ void l2norm_rows_g(ROW_MAP, float* __restrict__ y, int R, int D, float eps, float scale) {
    const int row = group_row<G>(), lane = threadIdx.x % G;
    if (row >= R) return;
    const float* xr = map_row(x, xs, xh, xhs, row);
    const float f = scale / sqrtf(row_sumsq<G>(xr, D) + eps);
    float* yr = y + (long long)row * D;
    for (int i = lane; i < D; i += G) yr[i] = xr[i] * f;
}
NORM_ENTRY(l2norm_rows, l2norm_rows_g, (ROW_MAP, float* __restrict__ y, int R, int D, int G, float eps, float scale),
           (x, xs, xh, xhs, y, R, D, eps, scale))
