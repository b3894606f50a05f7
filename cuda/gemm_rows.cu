// Few-row GEMM on the CUDA cores: out[M, N] (fp32) = A[M, K] (fp32) @ W[N, K]^T (fp16) (+ bias[N]), fp32 products
// and sums (no activation rounding: fp32-grade in every precision mode).
//
// numpy twin: clefcore/backends/cpu.py::linear.
//
// Why: the joint head's GEMMs have a handful of rows (its questions and options). gemm.cu's 128 x 128 tile puts
// such a product on N / 128 blocks, and cuBLAS needs the operand split and two passes for a few microseconds of
// work; both left the head's small GEMMs at ~50 us each on the H200. Here each warp streams NC weight rows once
// (16-byte loads) and dots them with up to RG activation rows. The block stages its activation rows for a pass
// of KP k values in shared memory (all loads in flight together: read straight from global memory, each row's
// loads waited on the previous row's, which made the time grow with the rows), and the next pass's weights are
// loaded while this one computes.
// grid (ceil(N / (8 NC)), ceil(M / RG)), 256 threads (8 warps); lane l covers k = kb + 8 l + 256 u; the 32
// partial sums of each output are added by a butterfly over the warp. Any M, N, K: when K % 8 != 0 or an operand
// is not 16-byte aligned, the loads go element by element.
#include "mma_sm70.cuh"

#define RG 16   // activation rows per block (grid.y covers the rest)
#define NC 2    // weight rows per warp
#define U 2     // 256-wide k steps per pass
#define KP (256 * U)   // k values per pass: the block's activation rows for them sit in shared memory (32 KB)

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
    __shared__ __align__(16) float As[RG][KP];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int n0 = (blockIdx.x * 8 + warp) * NC, m0 = blockIdx.y * RG, nr = min(RG, M - m0);
    const bool vec = (K & 7) == 0 && ((size_t)A & 15) == 0 && ((size_t)W & 15) == 0;
    // a warp past N still stages activations and meets every barrier; its weights are zeros, its outputs unwritten
    auto load_w = [&](int kb, unsigned (&w)[U][NC][4]) {
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int j = 0; j < NC; ++j) {
                if (n0 + j < N) load8h(W + (size_t)(n0 + j) * K, kb + 8 * lane + 256 * u, K, vec, w[u][j]);
                else
#pragma unroll
                    for (int i = 0; i < 4; ++i) w[u][j][i] = 0u;
            }
    };
    float acc[NC][RG];
#pragma unroll
    for (int j = 0; j < NC; ++j)
#pragma unroll
        for (int m = 0; m < RG; ++m) acc[j][m] = 0.f;
    unsigned w[U][NC][4], wn[U][NC][4];
    load_w(0, w);
    for (int kb = 0; kb < K; kb += KP) {
        if (kb + KP < K) load_w(kb + KP, wn);      // the next pass's weights travel while this one computes
        // the block's activation rows for this pass -> shared memory, every load issued before any is used
#pragma unroll
        for (int i = 0; i < RG * KP / 4 / 256; ++i) {
            const int e = tid + 256 * i, r = e / (KP / 4), c = (e % (KP / 4)) * 4;
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (r < nr) {
                const float* p = A + (size_t)(m0 + r) * K + kb + c;
                if (vec && kb + c + 4 <= K) v = *(const float4*)p;
                else if (kb + c < K) {
                    v.x = p[0];
                    if (kb + c + 1 < K) v.y = p[1];
                    if (kb + c + 2 < K) v.z = p[2];
                    if (kb + c + 3 < K) v.w = p[3];
                }
            }
            *(float4*)&As[r][c] = v;
        }
        __syncthreads();
#pragma unroll
        for (int m = 0; m < RG; ++m) {
            if (m >= nr) break;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const float4 a0 = *(const float4*)&As[m][8 * lane + 256 * u];
                const float4 a1 = *(const float4*)&As[m][8 * lane + 256 * u + 4];
                const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
#pragma unroll
                for (int j = 0; j < NC; ++j)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        acc[j][m] = fmaf(a[2 * i], h2f((half_t)(w[u][j][i] & 0xffffu)), acc[j][m]);
                        acc[j][m] = fmaf(a[2 * i + 1], h2f((half_t)(w[u][j][i] >> 16)), acc[j][m]);
                    }
            }
        }
        __syncthreads();                             // As is overwritten by the next pass
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int j = 0; j < NC; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) w[u][j][i] = wn[u][j][i];
    }
    if (n0 >= N) return;                             // after the last barrier: the warp's shuffles stay whole
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
