// Hopper GEMM (sm_90a): C[M, N] (fp32) = A[M, K] @ W[N, K]^T (+ bias[N]) (+ res[M, N]), fp16 operands, fp32
// accumulation, with warpgroup MMAs (wgmma.mma_async). The "mma" route on sm_90 (matmul.py); gemm_mma.cu keeps
// sm_80-89. Same arguments, launch preconditions and results as gemm_mma.cu's kernels.
//
// numpy twin: clefcore/backends/cpu.py::linear (plain, + bias, + residual).
//
// gemm_wgmma_f16a: block tile 128 x 256 x 64, 256 threads = 2 warpgroups, each 64 rows x 256 columns of C held
// in 128 fp32 registers a thread, grown by 4 wgmma m64n256k16 per k-tile that read A and W straight from shared
// memory through 64-bit matrix descriptors (no ldmatrix, no register copies of the operands). Why: mma.sync
// (gemm_mma.cu) reached 0.41-0.46 of cuBLAS on an H100; Hopper's tensor cores run at full rate only through
// wgmma, which is what cuBLAS issues there. On the H100 this kernel runs at 0.70-0.89 of cuBLAS from 512 rows up
// (0.49 at 346: 144 blocks for 132 SMs), 1.8-2.0x gemm_mma.cu's big tile; 256 x 128, 128 x 128 (6 stages) and a
// warp-specialized form (a copying warpgroup signalling mbarriers) measured slower
// (docs/bench/2026-12-05-h100-wgmma-gemm/).
//
// Layout: each stage holds the A tile (128 rows) then the W tile (256 rows), every row 64 halves = 128 bytes,
// with the 128-byte swizzle the descriptors name: 16-byte chunk c of row r sits at chunk c ^ (r % 8), in
// 1024-byte atoms of 8 rows (the stride-dimension offset); both operands are K-major, as the hardware's default.
// A k-step of 16 advances a descriptor's start address by 32 bytes; the hardware applies the XOR on the address.
//
// Pipeline: 4 stages (196,608 bytes + 1,024 for alignment) filled by cp.async from all 256 threads (16 bytes a
// copy, written straight to the swizzled place; rows past M or N and chunks past K are zero-filled through
// src-size 0). Per k-tile: wait for its copies, fence.proxy.async (cp.async writes through the generic proxy,
// wgmma reads through the async one), barrier, issue the wgmmas, then the copies of the tile two ahead into the
// stage read two tiles ago, then wait until only this k-tile's wgmmas are in flight: the tensor cores always
// have the next k-tile queued while the barrier and the copies run. 4 stages is the least for this order
// (copies of k+1 and k+2, wgmmas of k-1 and k, in four distinct stages).
//
// Needs K % 8 == 0 and 16-byte aligned A and W (the caller checks), as gemm_mma.cu: every 16-byte chunk is
// wholly inside or outside a row. The epilogue writes straight from the accumulators (two adjacent columns per
// register pair, the layout of mma.sync's m16n8 tiles repeated). Blocks walk the output in groups of 8 block
// rows, as gemm_mma.cu.
//
// gemm_wgmma_swiglu: the same tile as one GEMM over the MLP's gate and up weights paired 8 rows by 8
// (gemm_swiglu.cuh), writing H[M, N] = fp16(silu(A Wg^T) * (A Wu^T)) from the accumulators (the fused_elementwise
// switch): the bits of gemm_wgmma_f16a on Wg, on Wu and gemm.cu's swiglu_half, without their fp32 outputs.
//
// Built only for sm_90a (the feature macro __CUDA_ARCH_FEAT_SM90_ALL): other targets, compute_70 PTX and plain
// sm_90 included, compile to empty kernels, and the backend never routes to it there.
#include "gemm_tile.cuh"

#include "wgmma.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)

// d (64 x 256, fp32, this thread's share) += A (64 x 16) @ B (256 x 16)^T, both from shared memory
__device__ __forceinline__ void wg_mma_n256(float (&d)[128], unsigned long long da,
                                           unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {" WG_ACC128_NAMES
                 "}, %128, %129, 1, 1, 1, 0, 0;\n"
                 : WG_ACC128(d)
                 : "l"(da), "l"(db));
}

// one k-tile of A (rows m0..) and W (rows n0..) into a stage, in 16-byte chunks: thread t copies chunk t % 8 of
// rows t / 8 + 32 i, whose r % 8, and so the swizzled chunk, is the same for every i. SWIGLU: W's rows are the
// paired rows of W (gate) and Wu (up), gemm_swiglu.cuh
template <int BM, int BN, bool SWIGLU>
__device__ __forceinline__ void wg_load_stage(unsigned sA, unsigned sB, const wg_half* __restrict__ A,
                                              const wg_half* __restrict__ W, const wg_half* __restrict__ Wu, int M,
                                              int N, int K, int m0, int n0, int k0) {
    const int c = threadIdx.x & 7, r0 = threadIdx.x >> 3, gk = k0 + c * 8;
    const unsigned sw = (unsigned)((c ^ (r0 & 7)) << 4);
    const bool kok = gk < K;
#pragma unroll
    for (int i = 0; i < BM / 32; ++i) {
        const int r = r0 + 32 * i, gr = m0 + r;
        const bool ok = kok && gr < M;
        wg_cp16(sA + r * 128 + sw, A + (ok ? (size_t)gr * K + gk : 0), ok);
    }
#pragma unroll
    for (int i = 0; i < BN / 32; ++i) {
        const int r = r0 + 32 * i, gn = n0 + r;
        if (SWIGLU) {
            bool rok;
            const wg_half* row = swiglu_row(W, Wu, gn, N, K, rok);
            const bool ok = kok && rok;
            wg_cp16(sB + r * 128 + sw, row + (ok ? gk : 0), ok);
        } else {
            const bool ok = kok && gn < N;
            wg_cp16(sB + r * 128 + sw, W + (ok ? (size_t)gn * K + gk : 0), ok);
        }
    }
}

// one k-step of the warpgroup's BN columns (the sweep's 128-column tiles add wg_mma<128>:
// docs/bench/2026-12-05-h100-wgmma-gemm/variants.cu)
template <int BN>
__device__ __forceinline__ void wg_mma(float (&d)[BN / 2], unsigned long long da, unsigned long long db);
template <>
__device__ __forceinline__ void wg_mma<256>(float (&d)[128], unsigned long long da, unsigned long long db) {
    wg_mma_n256(d, da, db);
}

#endif

// SWIGLU: W and Wu are the gate and up weights ([N, K] each), the tile's columns their paired rows, and the
// output H [M, N] fp16 (bias, res and C unused); otherwise C [M, N] fp32 = A W^T (+ bias) (+ res), Wu and H unused.
// Empty on every target but sm_90a.
template <int BM, int BN, int STAGES, bool SWIGLU>
__device__ __forceinline__ void wg_gemm(const wg_half* __restrict__ A, const wg_half* __restrict__ W,
                                        const wg_half* __restrict__ Wu, const float* __restrict__ bias,
                                        const float* __restrict__ res, float* __restrict__ C,
                                        wg_half* __restrict__ H, int M, int N, int K) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BK = 64, WM = BM / 2, MI = WM / 64, NA = BN / 2;   // per warpgroup: WM rows, MI m64 blocks
    constexpr unsigned SA = BM * 128, STAGE = (BM + BN) * 128;       // bytes
    static_assert(WM % 64 == 0 && (BN == 128 || BN == 256) && STAGES >= 4, "tile shape");
    extern __shared__ unsigned char wg_buf[];
    const unsigned base = (wg_smem(wg_buf) + 1023u) & ~1023u;        // swizzle atoms are 1024-byte aligned
    const int t = threadIdx.x, wg = t >> 7, warp = (t >> 5) & 3, lane = t & 31;
    int bm, bn;
    gemm_block_order(bm, bn);
    const int m0 = bm * BM, n0 = bn * BN;
    const int KT = (K + BK - 1) / BK;

    float acc[MI][NA];
#pragma unroll
    for (int i = 0; i < MI; ++i) {
#pragma unroll
        for (int j = 0; j < NA; ++j) acc[i][j] = 0.f;
        wg_fence_acc(acc[i]);
    }

#pragma unroll
    for (int s = 0; s < STAGES - 2; ++s) {
        if (s < KT)
            wg_load_stage<BM, BN, SWIGLU>(base + s * STAGE, base + s * STAGE + SA, A, W, Wu, M, N, K, m0, n0, s * BK);
        asm volatile("cp.async.commit_group;\n" ::);             // empty groups keep the count uniform
    }

    for (int kt = 0; kt < KT; ++kt) {
        asm volatile("cp.async.wait_group %0;\n" :: "n"(STAGES - 3));   // k-tile kt has landed (this thread's part)
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();                                  // ... every thread's; the wgmmas of kt - 2 are done
        const unsigned sA = base + (kt % STAGES) * STAGE + wg * WM * 128, sB = base + (kt % STAGES) * STAGE + SA;
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks)
#pragma unroll
            for (int i = 0; i < MI; ++i)
                wg_mma<BN>(acc[i], wg_desc(sA + i * 64 * 128 + ks * 32), wg_desc(sB + ks * 32));
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        {
            const int pf = kt + STAGES - 2;               // into the stage of kt - 2
            if (pf < KT) {
                const unsigned st = base + (pf % STAGES) * STAGE;
                wg_load_stage<BM, BN, SWIGLU>(st, st + SA, A, W, Wu, M, N, K, m0, n0, pf * BK);
            }
            asm volatile("cp.async.commit_group;\n" ::);
        }
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");   // kt - 1's are done
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    asm volatile("cp.async.wait_group 0;\n" ::);
#pragma unroll
    for (int i = 0; i < MI; ++i) wg_fence_acc(acc[i]);

    // accumulator (i, 4 j + e): row wg*WM + i*64 + warp*16 + lane/4 (+ 8 for e >= 2), column 8 j + (lane % 4) * 2
    // (+ 1 for odd e)
    const bool pair = (N & 1) == 0;                       // float2 stores stay 8-byte aligned
#pragma unroll
    for (int i = 0; i < MI; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int gr = m0 + wg * WM + i * 64 + warp * 16 + (lane >> 2) + h * 8;
            if (gr >= M) continue;
            gemm_store_row<BN / 8, SWIGLU>(bias, res, C, H, N, pair, gr, n0, lane,
                                           [&](int j, int e) { return acc[i][j * 4 + h * 2 + e]; });
        }
    }
#endif
}

// The launch: grid (ceil(N / 256), ceil(M / 128)), 256 threads, 197,632 bytes of dynamic shared memory. The fused
// MLP (MMA_SWIGLU in matmul.py): grid (ceil(16 ceil(N / 8) / 256), ceil(M / 128)), 256 threads, the same dynamic
// shared memory; N = the gate's (and up's) rows = H's columns.
GEMM_F32_ENTRY(gemm_wgmma_f16a, __launch_bounds__(256, 1), wg_gemm, 128, 256, 4)
GEMM_SWIGLU_ENTRY(gemm_wgmma_swiglu, __launch_bounds__(256, 1), wg_gemm, 128, 256, 4)
