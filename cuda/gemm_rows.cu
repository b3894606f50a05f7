// Few-row GEMM on the CUDA cores: out[M, N] (fp32) = A[M, K] (fp32) @ W[N, K]^T (fp16) (+ bias[N]), fp32 products
// and sums (no activation rounding: fp32-grade in every precision mode).
//
// numpy twin: clefcore/backends/cpu.py::linear.
//
// Why: the joint head's GEMMs have a handful of rows (its questions and options). gemm.cu's 128 x 128 tile puts
// such a product on N / 128 blocks, and cuBLAS needs the operand split and two passes for a few microseconds of
// work; both left the head's small GEMMs at ~50 us each on the H200. Here each warp streams NC weight rows once
// (16-byte loads) and dots them with up to RG activation rows, which stay in L1: the time is the weight read.
// grid (ceil(N / (8 NC)), ceil(M / RG)), 256 threads (8 warps); lane l covers k = 8 l + 256 i; the 32 partial
// sums of each output are added by a butterfly over the warp. Any M, N, K: when K % 8 != 0 or an operand is not
// 16-byte aligned, the same loop reads element by element.
#include "mma_sm70.cuh"

#define RG 16   // activation rows per block (grid.y covers the rest)
#define NC 2    // weight rows per warp
#define U 4     // k steps whose weights are in flight together

// 8 consecutive values of a row from column k, zeros past K
__device__ __forceinline__ void load8(const float* __restrict__ p, int k, int K, bool vec, float (&x)[8]) {
    if (vec && k + 8 <= K) {
        const float4 a = *(const float4*)(p + k), b = *(const float4*)(p + k + 4);
        x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w; x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
        return;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = k + i < K ? p[k + i] : 0.f;
}
// 8 consecutive halves of a row from column k as 4 packed pairs (kept packed: half the registers), zeros past K
__device__ __forceinline__ void load8h(const half_t* __restrict__ p, int k, int K, bool vec, unsigned (&w)[4]) {
    if (vec && k + 8 <= K) {
        const uint4 u = *(const uint4*)(p + k);
        w[0] = u.x; w[1] = u.y; w[2] = u.z; w[3] = u.w;
        return;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
        w[i] = (unsigned)(k + 2 * i < K ? p[k + 2 * i] : (half_t)0) |
               ((unsigned)(k + 2 * i + 1 < K ? p[k + 2 * i + 1] : (half_t)0) << 16);
}

extern "C" __global__ void __launch_bounds__(256) gemm_rows(const float* __restrict__ A, const half_t* __restrict__ W,
                                                            const float* __restrict__ bias, float* __restrict__ out,
                                                            int M, int N, int K) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n0 = (blockIdx.x * 8 + warp) * NC, m0 = blockIdx.y * RG, nr = min(RG, M - m0);
    if (n0 >= N) return;
    const bool vec = (K & 7) == 0 && ((size_t)A & 15) == 0 && ((size_t)W & 15) == 0;
    float acc[NC][RG];
#pragma unroll
    for (int j = 0; j < NC; ++j)
#pragma unroll
        for (int m = 0; m < RG; ++m) acc[j][m] = 0.f;
    // U steps of 256 k per pass: their weight loads are all issued before any is used (one HBM round trip
    // per pass, not per step: a step's FMAs are far shorter than the load latency)
    for (int k0 = 8 * lane; k0 < K; k0 += 256 * U) {
        unsigned w[U][NC][4];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int j = 0; j < NC; ++j) {
                if (n0 + j < N) load8h(W + (size_t)(n0 + j) * K, k0 + 256 * u, K, vec, w[u][j]);
                else
#pragma unroll
                    for (int i = 0; i < 4; ++i) w[u][j][i] = 0u;
            }
#pragma unroll
        for (int m = 0; m < RG; ++m) {
            if (m >= nr) break;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                float a[8];
                load8(A + (size_t)(m0 + m) * K, k0 + 256 * u, K, vec, a);
#pragma unroll
                for (int j = 0; j < NC; ++j)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        acc[j][m] = fmaf(a[2 * i], h2f((half_t)(w[u][j][i] & 0xffffu)), acc[j][m]);
                        acc[j][m] = fmaf(a[2 * i + 1], h2f((half_t)(w[u][j][i] >> 16)), acc[j][m]);
                    }
            }
        }
    }
#pragma unroll
    for (int j = 0; j < NC; ++j) {
        const float b = bias != nullptr && n0 + j < N ? bias[n0 + j] : 0.f;
#pragma unroll
        for (int m = 0; m < RG; ++m) {
            if (m >= nr) break;
            float v = acc[j][m];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == m && n0 + j < N) out[(size_t)(m0 + m) * N + n0 + j] = v + b;
        }
    }
}
