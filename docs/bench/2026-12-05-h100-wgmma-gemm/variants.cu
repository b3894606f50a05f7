
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
// the 128-column tiles' k-step: d (64 x 128) += A (64 x 16) @ B (128 x 16)^T, both from shared memory
__device__ __forceinline__ void wg_mma_n128(float (&d)[64], unsigned long long da,
                                           unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
                 "}, %64, %65, 1, 1, 1, 0, 0;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
                   "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
                   "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
                   "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
                   "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
                   "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
                   "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
                   "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
                   "+f"(d[63])
                 : "l"(da), "l"(db));
}

template <>
__device__ __forceinline__ void wg_mma<128>(float (&d)[64], unsigned long long da, unsigned long long db) {
    wg_mma_n128(d, da, db);
}

__device__ __forceinline__ void wg_bar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void wg_bar_arrive(unsigned bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void wg_bar_wait(unsigned bar, unsigned parity) {
    asm volatile("{\n.reg .pred p;\nWG_WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra WG_WAIT;\n}\n" :: "r"(bar), "r"(parity) : "memory");
}

// warp-specialized: warpgroup 0 copies (cp.async, LAG tiles in flight), warpgroups 1, 2 multiply
template <int BM, int BN, int STAGES, int LAG>
__device__ __forceinline__ void wg_gemm_ws(const wg_half* __restrict__ A, const wg_half* __restrict__ W,
                                           const float* __restrict__ bias, const float* __restrict__ res,
                                           float* __restrict__ C, int M, int N, int K) {
    constexpr int BK = 64, WM = BM / 2, MI = WM / 64, NA = BN / 2;
    constexpr unsigned SA = BM * 128, STAGE = (BM + BN) * 128;
    static_assert(WM % 64 == 0 && (BN == 128 || BN == 256) && LAG >= 1 && LAG <= STAGES - 2, "tile shape");
    extern __shared__ unsigned char wg_buf[];
    __shared__ __align__(8) unsigned long long bars[2 * STAGES];   // full[s], then empty[s]
    const unsigned base = (wg_smem(wg_buf) + 1023u) & ~1023u;
    const unsigned full = wg_smem(bars), empty = full + 8 * STAGES;
    const int t = threadIdx.x, wg = t >> 7;
    if (t == 0) {
        for (int s = 0; s < STAGES; ++s) {
            wg_bar_init(full + 8 * s, 128);
            wg_bar_init(empty + 8 * s, 256);
        }
    }
    __syncthreads();
    int bm, bn;
    {
        const int grid_m = gridDim.y, pid = blockIdx.y * gridDim.x + blockIdx.x, width = 8 * gridDim.x;
        const int first = (pid / width) * 8, rows = min(grid_m - first, 8);
        bm = first + (pid % width) % rows;
        bn = (pid % width) / rows;
    }
    const int m0 = bm * BM, n0 = bn * BN;
    const int KT = (K + BK - 1) / BK;

    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        const int c = t & 7, r0 = t >> 3;
        const unsigned sw = (unsigned)((c ^ (r0 & 7)) << 4);
        for (int kt = 0; kt < KT; ++kt) {
            const int s = kt % STAGES;
            if (kt >= STAGES) wg_bar_wait(empty + 8 * s, ((kt / STAGES) - 1) & 1);
            const unsigned sA = base + s * STAGE, sB = sA + SA;
            const int gk = kt * BK + c * 8;
            const bool kok = gk < K;
#pragma unroll
            for (int i = 0; i < BM / 16; ++i) {
                const int r = r0 + 16 * i, gr = m0 + r;
                const bool ok = kok && gr < M;
                wg_cp16(sA + r * 128 + sw, A + (ok ? (size_t)gr * K + gk : 0), ok);
            }
#pragma unroll
            for (int i = 0; i < BN / 16; ++i) {
                const int r = r0 + 16 * i, gn = n0 + r;
                const bool ok = kok && gn < N;
                wg_cp16(sB + r * 128 + sw, W + (ok ? (size_t)gn * K + gk : 0), ok);
            }
            asm volatile("cp.async.commit_group;\n" ::);
            if (kt >= LAG) {
                asm volatile("cp.async.wait_group %0;\n" :: "n"(LAG));
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                wg_bar_arrive(full + 8 * ((kt - LAG) % STAGES));
            }
        }
        asm volatile("cp.async.wait_group 0;\n" ::);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        for (int kt = max(KT - LAG, 0); kt < KT; ++kt) wg_bar_arrive(full + 8 * (kt % STAGES));
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
        const int cw = wg - 1, warp = (t >> 5) & 3, lane = t & 31;
        float acc[MI][NA];
#pragma unroll
        for (int i = 0; i < MI; ++i) {
#pragma unroll
            for (int j = 0; j < NA; ++j) acc[i][j] = 0.f;
            wg_fence_acc(acc[i]);
        }
        for (int kt = 0; kt < KT; ++kt) {
            const int s = kt % STAGES;
            wg_bar_wait(full + 8 * s, (kt / STAGES) & 1);
            const unsigned sA = base + s * STAGE + cw * WM * 128, sB = base + s * STAGE + SA;
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
            for (int ks = 0; ks < BK / 16; ++ks)
#pragma unroll
                for (int i = 0; i < MI; ++i)
                    wg_mma<BN>(acc[i], wg_desc(sA + i * 64 * 128 + ks * 32), wg_desc(sB + ks * 32));
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
            if (kt > 0) wg_bar_arrive(empty + 8 * ((kt - 1) % STAGES));
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
        for (int i = 0; i < MI; ++i) wg_fence_acc(acc[i]);
        const bool pair = (N & 1) == 0;
#pragma unroll
        for (int i = 0; i < MI; ++i) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int gr = m0 + cw * WM + i * 64 + warp * 16 + (lane >> 2) + h * 8;
                if (gr >= M) continue;
#pragma unroll
                for (int j = 0; j < BN / 8; ++j) {
                    const int gc = n0 + j * 8 + (lane & 3) * 2;
                    float v0 = acc[i][j * 4 + h * 2], v1 = acc[i][j * 4 + h * 2 + 1];
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
    }
}
#endif

extern "C" __global__ void __launch_bounds__(256, 1) v256x128s4(const wg_half* __restrict__ A,
    const wg_half* __restrict__ W, const float* __restrict__ bias, const float* __restrict__ res,
    float* __restrict__ C, int M, int N, int K) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    wg_gemm<256, 128, 4>(A, W, bias, res, C, M, N, K);
#endif
}
extern "C" __global__ void __launch_bounds__(256, 1) v128x128s6(const wg_half* __restrict__ A,
    const wg_half* __restrict__ W, const float* __restrict__ bias, const float* __restrict__ res,
    float* __restrict__ C, int M, int N, int K) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    wg_gemm<128, 128, 6>(A, W, bias, res, C, M, N, K);
#endif
}
extern "C" __global__ void __launch_bounds__(384, 1) ws128x256s4(const wg_half* __restrict__ A,
    const wg_half* __restrict__ W, const float* __restrict__ bias, const float* __restrict__ res,
    float* __restrict__ C, int M, int N, int K) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    wg_gemm_ws<128, 256, 4, 2>(A, W, bias, res, C, M, N, K);
#endif
}
extern "C" __global__ void __launch_bounds__(384, 1) ws256x128s4(const wg_half* __restrict__ A,
    const wg_half* __restrict__ W, const float* __restrict__ bias, const float* __restrict__ res,
    float* __restrict__ C, int M, int N, int K) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    wg_gemm_ws<256, 128, 4, 2>(A, W, bias, res, C, M, N, K);
#endif
}
extern "C" __global__ void __launch_bounds__(384, 1) ws128x128s6(const wg_half* __restrict__ A,
    const wg_half* __restrict__ W, const float* __restrict__ bias, const float* __restrict__ res,
    float* __restrict__ C, int M, int N, int K) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    wg_gemm_ws<128, 128, 6, 3>(A, W, bias, res, C, M, N, K);
#endif
}
