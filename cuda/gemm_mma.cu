// Tensor-core GEMM for sm_80+: C[M, N] (fp32) = A[M, K] @ W[N, K]^T (+ bias[N]) (+ res[M, N]), fp16 operands,
// fp32 accumulation. The fast plan's route on Ampere and Hopper ("mma", matmul.py); sm_70 keeps gemm.cu's wmma.
//
// numpy twin: clefcore/backends/cpu.py::linear (plain, + bias, + residual).
//
// Block tile BM x BN x BK (default 128 x 128 x 32), warps in a WARPS_M x WARPS_N grid (default 2 x 4, each warp
// 64 x 32: per 16-deep k step 4 ldmatrix.x4 for A, 2 for W, 16 mma.sync m16n8k16, 64 fp32 accumulators per
// thread). Tiles reach shared memory through a STAGES-deep cp.async pipeline (global -> shared without
// registers, the next tiles in flight while the tensor cores work on this one); rows are padded by 8 halves
// (80 bytes at BK 32, 144 at 64) so that the eight 16-byte rows of an ldmatrix phase fall on distinct banks. Rows past M or N and k-chunks past K are
// zero-filled by cp.async itself (src-size 0). Needs K % 8 == 0 and 16-byte aligned A and W: every 16-byte
// chunk is then wholly inside or outside a row (the caller checks). The epilogue writes straight from the
// accumulators (two adjacent columns per register pair). Blocks walk the output in groups of 8 block rows.
//
// Older architectures compile this file to empty kernels (the compute_70 PTX of every file is built in CI);
// the backend never routes to it there.

// The tile shape is fixed at build time; the defaults are the shape matmul.py launches (MMA_TILE, MMA_SMEM
// follow it). -D overrides exist for the tile sweep that chose them (docs/benchmarks.md, issue 30).
#ifndef MG_BM
#define MG_BM 128
#endif
#ifndef MG_BN
#define MG_BN 128
#endif
#ifndef MG_BK
#define MG_BK 32
#endif
#ifndef MG_STAGES
#define MG_STAGES 3
#endif
#ifndef MG_WARPS_M                     // warps along M and along N; each warp owns a (BM / WARPS_M) x
#define MG_WARPS_M 2                   // (BN / WARPS_N) tile of the output
#endif
#ifndef MG_WARPS_N
#define MG_WARPS_N 4
#endif
#define MG_THREADS (MG_WARPS_M * MG_WARPS_N * 32)
#define MG_MI (MG_BM / MG_WARPS_M / 16)   // m16 tiles per warp
#define MG_NJ (MG_BN / MG_WARPS_N / 8)    // n8 tiles per warp (even: one ldmatrix.x4 loads two)
#define MG_LDS (MG_BK + 8)            // padded row, halves
#define MG_STAGE_HALVES ((MG_BM + MG_BN) * MG_LDS)
// dynamic shared memory: STAGES x (BM + BN) x LDS halves; the default 3 x 256 x 40 x 2 = 61,440 bytes

typedef unsigned short mg_half;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
__device__ __forceinline__ unsigned mg_smem(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// 16 bytes global -> shared, asynchronously; ok = false writes zeros and reads nothing
__device__ __forceinline__ void mg_cp16(void* dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(mg_smem(dst)), "l"(src), "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void mg_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void mg_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

__device__ __forceinline__ void mg_ldsm4(unsigned (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(mg_smem(p)));
}

__device__ __forceinline__ void mg_mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// one k-tile of A (rows m0..) and W (rows n0..) into a stage, in 16-byte chunks of 8 halves
__device__ __forceinline__ void mg_load_stage(mg_half* sA, mg_half* sB, const mg_half* __restrict__ A,
                                              const mg_half* __restrict__ W, int M, int N, int K, int m0,
                                              int n0, int k0) {
    constexpr int per_row = MG_BK / 8;
#pragma unroll
    for (int c = threadIdx.x; c < MG_BM * per_row; c += MG_THREADS) {
        const int r = c / per_row, kk = (c % per_row) * 8, gk = k0 + kk, gr = m0 + r;
        const bool ok = gk < K && gr < M;
        mg_cp16(sA + r * MG_LDS + kk, A + (size_t)(ok ? gr : 0) * K + (ok ? gk : 0), ok);
    }
#pragma unroll
    for (int c = threadIdx.x; c < MG_BN * per_row; c += MG_THREADS) {
        const int r = c / per_row, kk = (c % per_row) * 8, gk = k0 + kk, gn = n0 + r;
        const bool ok = gk < K && gn < N;
        mg_cp16(sB + r * MG_LDS + kk, W + (size_t)(ok ? gn : 0) * K + (ok ? gk : 0), ok);
    }
}
#endif

extern "C" __global__ void __launch_bounds__(MG_THREADS) gemm_mma_f16a(const mg_half* __restrict__ A,
                                                               const mg_half* __restrict__ W,
                                                               const float* __restrict__ bias,
                                                               const float* __restrict__ res,
                                                               float* __restrict__ C, int M, int N, int K) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    extern __shared__ __align__(16) mg_half mg_smem_buf[];
    const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
    const int wm = warp / MG_WARPS_N, wn = warp % MG_WARPS_N;
    constexpr int WTM = MG_BM / MG_WARPS_M, WTN = MG_BN / MG_WARPS_N;
    // Blocks are launched in order of blockIdx.x fastest; handing them out down groups of 8 block rows (then
    // across) makes 8 consecutive blocks share one W tile column while it is in L2: at N = 12,288, K = 4096
    // the weight (100 MB) no longer streams from memory once per block row.
    int bm, bn;
    {
        const int grid_m = gridDim.y, pid = blockIdx.y * gridDim.x + blockIdx.x, width = 8 * gridDim.x;
        const int first = (pid / width) * 8, rows = min(grid_m - first, 8);
        bm = first + (pid % width) % rows;
        bn = (pid % width) / rows;
    }
    const int m0 = bm * MG_BM, n0 = bn * MG_BN;
    const int KT = (K + MG_BK - 1) / MG_BK;

    float acc[MG_MI][MG_NJ][4];
#pragma unroll
    for (int i = 0; i < MG_MI; ++i)
#pragma unroll
        for (int j = 0; j < MG_NJ; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

#pragma unroll
    for (int s = 0; s < MG_STAGES - 1; ++s) {
        if (s < KT) {
            mg_half* st = mg_smem_buf + s * MG_STAGE_HALVES;
            mg_load_stage(st, st + MG_BM * MG_LDS, A, W, M, N, K, m0, n0, s * MG_BK);
        }
        mg_commit();                                      // empty groups keep the count uniform
    }

    // ldmatrix row addresses of this lane: A, 16 rows x (k, k + 8); W, (n, n + 8) x (k, k + 8)
    const int a_row = lane & 15, a_col = (lane >> 4) * 8;
    const int b_row = (lane & 7) + ((lane >> 4) << 3), b_col = ((lane >> 3) & 1) * 8;

    for (int kt = 0; kt < KT; ++kt) {
        mg_wait<MG_STAGES - 2>();                         // k-tile kt has landed
        __syncthreads();                                  // ... for every thread, and stage kt-1 is free
        {
            const int pf = kt + MG_STAGES - 1;
            if (pf < KT) {
                mg_half* st = mg_smem_buf + (pf % MG_STAGES) * MG_STAGE_HALVES;
                mg_load_stage(st, st + MG_BM * MG_LDS, A, W, M, N, K, m0, n0, pf * MG_BK);
            }
            mg_commit();
        }
        const mg_half* sA = mg_smem_buf + (kt % MG_STAGES) * MG_STAGE_HALVES;
        const mg_half* sB = sA + MG_BM * MG_LDS;
#pragma unroll
        for (int ks = 0; ks < MG_BK; ks += 16) {
            unsigned a[MG_MI][4], b[MG_NJ / 2][4];
#pragma unroll
            for (int i = 0; i < MG_MI; ++i)
                mg_ldsm4(a[i], sA + (wm * WTM + i * 16 + a_row) * MG_LDS + ks + a_col);
#pragma unroll
            for (int j = 0; j < MG_NJ / 2; ++j)
                mg_ldsm4(b[j], sB + (wn * WTN + j * 16 + b_row) * MG_LDS + ks + b_col);
#pragma unroll
            for (int i = 0; i < MG_MI; ++i)
#pragma unroll
                for (int j = 0; j < MG_NJ; ++j)
                    mg_mma(acc[i][j], a[i], b[j >> 1][(j & 1) * 2], b[j >> 1][(j & 1) * 2 + 1]);
        }
    }
    mg_wait<0>();

    // accumulator (i, j): rows wm*WTM + i*16 + lane/4 (+ 8), columns wn*WTN + j*8 + (lane % 4) * 2 (+ 1)
    const bool pair = (N & 1) == 0;                       // float2 stores stay 8-byte aligned
#pragma unroll
    for (int i = 0; i < MG_MI; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int gr = m0 + wm * WTM + i * 16 + (lane >> 2) + h * 8;
            if (gr >= M) continue;
#pragma unroll
            for (int j = 0; j < MG_NJ; ++j) {
                const int gc = n0 + wn * WTN + j * 8 + (lane & 3) * 2;
                float v0 = acc[i][j][h * 2], v1 = acc[i][j][h * 2 + 1];
                const size_t o = (size_t)gr * N + gc;
                if (pair && gc + 1 < N) {
                    if (bias) { v0 += bias[gc]; v1 += bias[gc + 1]; }
                    if (res) { const float2 r = *(const float2*)(res + o); v0 += r.x; v1 += r.y; }
                    *(float2*)(C + o) = make_float2(v0, v1);
                } else {
                    if (gc < N) C[o] = v0 + (bias ? bias[gc] : 0.f) + (res ? res[o] : 0.f);
                    if (gc + 1 < N) C[o + 1] = v1 + (bias ? bias[gc + 1] : 0.f) + (res ? res[o + 1] : 0.f);
                }
            }
        }
    }
#endif
}
