// Tensor-core GEMM for sm_80+: C[M, N] (fp32) = A[M, K] @ W[N, K]^T (+ bias[N]) (+ res[M, N]), fp16 operands,
// fp32 accumulation. The fast plan's "mma" route (matmul.py) on Ampere and Ada; Hopper takes gemm_wgmma.cu on it,
// sm_70 keeps gemm.cu's wmma.
//
// numpy twin: clefcore/backends/cpu.py::linear (plain, + bias, + residual).
//
// Two tiles, one template (mg_gemm<BM, BN, BK, STAGES, WARPS_M, WARPS_N>), chosen by matmul.py from the GPU's
// shared memory per block (MMA_TILES):
//   gemm_mma_f16a_big  256 x 128 x 64, 3 stages, 8 warps of 64 x 64: 165,888 bytes (A100, H100)
//   gemm_mma_f16a      128 x 128 x 32, 3 stages, 8 warps of 64 x 32:  61,440 bytes (every sm_80+, incl. the
//                      99 KiB of sm_86 / sm_89)
// A tile sweep on an H100 (docs/bench/2026-12-05-h100-mma-gemm/) put the first at 0.41-0.46 of cuBLAS on the model's
// shapes and the second at 0.35-0.39. Per 16-deep k step a warp loads its A rows (one ldmatrix.x4 per 16) and
// W rows (one per 16) and issues (rows / 16) x (columns / 8) mma.sync m16n8k16. Tiles reach shared memory through
// a 3-stage cp.async pipeline (global -> shared without registers, the next tiles in flight while the tensor
// cores work on this one); rows are padded by 8 halves (80 bytes at BK 32, 144 at 64) so that the eight 16-byte
// rows of an ldmatrix phase fall on distinct banks. Rows past M or N and k-chunks past K are zero-filled by
// cp.async itself (src-size 0). Needs K % 8 == 0 and 16-byte aligned A and W: every 16-byte chunk is then wholly
// inside or outside a row (the caller checks). The epilogue writes straight from the accumulators (two adjacent
// columns per register pair). Blocks walk the output in groups of 8 block rows.
//
// gemm_mma_swiglu{_big}: the same tiles as one GEMM over the MLP's gate and up weights paired 8 rows by 8
// (gemm_swiglu.cuh), writing H[M, N] = fp16(silu(A Wg^T) * (A Wu^T)) from the accumulators (the fused_elementwise
// switch): the bits of gemm_mma_f16a on Wg, on Wu and gemm.cu's swiglu_half, without their fp32 [M, N] outputs.
//
// Older architectures compile this file to empty kernels (the compute_70 PTX of every file is built in CI);
// the backend never routes to it there.
#include "gemm_tile.cuh"

typedef unsigned short mg_half;

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

// one k-tile of A (rows m0..) and W (rows n0..) into a stage, in 16-byte chunks of 8 halves; SWIGLU: W's rows are
// the paired rows of W (gate) and Wu (up), gemm_swiglu.cuh
template <int BM, int BN, int BK, int THREADS, bool SWIGLU>
__device__ __forceinline__ void mg_load_stage(mg_half* sA, mg_half* sB, const mg_half* __restrict__ A,
                                              const mg_half* __restrict__ W, const mg_half* __restrict__ Wu,
                                              int M, int N, int K, int m0, int n0, int k0) {
    constexpr int per_row = BK / 8, lds = BK + 8;
#pragma unroll
    for (int c = threadIdx.x; c < BM * per_row; c += THREADS) {
        const int r = c / per_row, kk = (c % per_row) * 8, gk = k0 + kk, gr = m0 + r;
        const bool ok = gk < K && gr < M;
        mg_cp16(sA + r * lds + kk, A + (size_t)(ok ? gr : 0) * K + (ok ? gk : 0), ok);
    }
#pragma unroll
    for (int c = threadIdx.x; c < BN * per_row; c += THREADS) {
        const int r = c / per_row, kk = (c % per_row) * 8, gk = k0 + kk, gn = n0 + r;
        if (SWIGLU) {
            bool rok;
            const mg_half* row = swiglu_row(W, Wu, gn, N, K, rok);
            const bool ok = rok && gk < K;
            mg_cp16(sB + r * lds + kk, row + (ok ? gk : 0), ok);
        } else {
            const bool ok = gk < K && gn < N;
            mg_cp16(sB + r * lds + kk, W + (size_t)(ok ? gn : 0) * K + (ok ? gk : 0), ok);
        }
    }
}

// SWIGLU: W and Wu are the gate and up weights ([N, K] each), the tile's columns their paired rows, and the
// output H [M, N] fp16 (bias, res and C unused); otherwise C [M, N] fp32 = A W^T (+ bias) (+ res), Wu and H unused.
// Empty before sm_80 (the helpers above are then never emitted).
template <int BM, int BN, int BK, int STAGES, int WARPS_M, int WARPS_N, bool SWIGLU>
__device__ __forceinline__ void mg_gemm(const mg_half* __restrict__ A, const mg_half* __restrict__ W,
                                        const mg_half* __restrict__ Wu, const float* __restrict__ bias,
                                        const float* __restrict__ res, float* __restrict__ C,
                                        mg_half* __restrict__ H, int M, int N, int K) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    constexpr int THREADS = WARPS_M * WARPS_N * 32, LDS = BK + 8, STAGE = (BM + BN) * LDS;
    constexpr int WTM = BM / WARPS_M, WTN = BN / WARPS_N;   // each warp's output tile
    constexpr int MI = WTM / 16, NJ = WTN / 8;              // its m16 and n8 tiles (NJ even: x4 loads two)
    // NJ even: x4 loads two n8 tiles; SWIGLU also pairs them, so each warp's columns start at a multiple of 16
    static_assert(NJ % 2 == 0 && WTN % 16 == 0 && WTM % 16 == 0 && BK % 16 == 0 && BN % 16 == 0, "tile shape");
    extern __shared__ __align__(16) mg_half mg_smem_buf[];
    const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    int bm, bn;
    gemm_block_order(bm, bn);
    const int m0 = bm * BM, n0 = bn * BN;
    const int KT = (K + BK - 1) / BK;

    float acc[MI][NJ][4];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KT) {
            mg_half* st = mg_smem_buf + s * STAGE;
            mg_load_stage<BM, BN, BK, THREADS, SWIGLU>(st, st + BM * LDS, A, W, Wu, M, N, K, m0, n0, s * BK);
        }
        mg_commit();                                      // empty groups keep the count uniform
    }

    // ldmatrix row addresses of this lane: A, 16 rows x (k, k + 8); W, (n, n + 8) x (k, k + 8)
    const int a_row = lane & 15, a_col = (lane >> 4) * 8;
    const int b_row = (lane & 7) + ((lane >> 4) << 3), b_col = ((lane >> 3) & 1) * 8;

    for (int kt = 0; kt < KT; ++kt) {
        mg_wait<STAGES - 2>();                         // k-tile kt has landed
        __syncthreads();                                  // ... for every thread, and stage kt-1 is free
        {
            const int pf = kt + STAGES - 1;
            if (pf < KT) {
                mg_half* st = mg_smem_buf + (pf % STAGES) * STAGE;
                mg_load_stage<BM, BN, BK, THREADS, SWIGLU>(st, st + BM * LDS, A, W, Wu, M, N, K, m0, n0, pf * BK);
            }
            mg_commit();
        }
        const mg_half* sA = mg_smem_buf + (kt % STAGES) * STAGE;
        const mg_half* sB = sA + BM * LDS;
#pragma unroll
        for (int ks = 0; ks < BK; ks += 16) {
            unsigned a[MI][4], b[NJ / 2][4];
#pragma unroll
            for (int i = 0; i < MI; ++i)
                mg_ldsm4(a[i], sA + (wm * WTM + i * 16 + a_row) * LDS + ks + a_col);
#pragma unroll
            for (int j = 0; j < NJ / 2; ++j)
                mg_ldsm4(b[j], sB + (wn * WTN + j * 16 + b_row) * LDS + ks + b_col);
#pragma unroll
            for (int i = 0; i < MI; ++i)
#pragma unroll
                for (int j = 0; j < NJ; ++j)
                    mg_mma(acc[i][j], a[i], b[j >> 1][(j & 1) * 2], b[j >> 1][(j & 1) * 2 + 1]);
        }
    }
    mg_wait<0>();

    // accumulator (i, j): rows wm*WTM + i*16 + lane/4 (+ 8), columns wn*WTN + j*8 + (lane % 4) * 2 (+ 1)
    const bool pair = (N & 1) == 0;                       // float2 stores stay 8-byte aligned
#pragma unroll
    for (int i = 0; i < MI; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int gr = m0 + wm * WTM + i * 16 + (lane >> 2) + h * 8;
            if (gr >= M) continue;
            gemm_store_row<NJ, SWIGLU>(bias, res, C, H, N, pair, gr, n0 + wn * WTN, lane,
                                       [&](int j, int e) { return acc[i][j][h * 2 + e]; });
        }
    }
#endif
}

// The launch: grid (ceil(N / BN), ceil(M / BM)), 256 threads, the tile's dynamic shared memory. The fused MLP
// (MMA_SWIGLU in matmul.py): grid (ceil(16 ceil(N / 8) / BN), ceil(M / BM)), 256 threads, the same dynamic shared
// memory as the tile's plain kernel; N = the gate's (and up's) rows = H's columns.
#define MG_BIG 256, 128, 64, 3, 4, 2     // BM, BN, BK, STAGES, WARPS_M, WARPS_N
#define MG_SMALL 128, 128, 32, 3, 2, 4
GEMM_F32_ENTRY(gemm_mma_f16a_big, __launch_bounds__(256), mg_gemm, MG_BIG)
GEMM_F32_ENTRY(gemm_mma_f16a, __launch_bounds__(256), mg_gemm, MG_SMALL)
GEMM_SWIGLU_ENTRY(gemm_mma_swiglu_big, __launch_bounds__(256), mg_gemm, MG_BIG)
GEMM_SWIGLU_ENTRY(gemm_mma_swiglu, __launch_bounds__(256), mg_gemm, MG_SMALL)
#undef MG_BIG
#undef MG_SMALL
