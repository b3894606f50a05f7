// Hopper (sm_90a) building blocks shared by the warpgroup-MMA kernels (gemm_wgmma.cu, attention_wgmma.cu): the
// shared-memory address of a pointer, the zero-filling 16-byte cp.async, the matrix descriptors of operands laid
// out in 128-byte-swizzled rows, the accumulator operand lists of the wgmma inline asm, and the compiler fence
// that pins register accesses after a wgmma wait.
//
// No numpy twin: this is a building block. Everything but the wg_half type is built for sm_90a only (the feature
// macro __CUDA_ARCH_FEAT_SM90_ALL); the kernels that include it compile to empty bodies elsewhere.
//
// The operand layout both descriptors describe (PTX's canonical 128-byte-swizzle layouts; CUTLASS's
// make_gmma_desc names the same fields): rows of 64 halves = 128 bytes, 16-byte chunk c of row r stored at chunk
// c ^ (r % 8), in 1024-byte atoms of 8 rows that must start 1024-byte aligned (the hardware applies the XOR on
// the address bits, 4-6 ^= 7-9). A "panel" is such a block of rows holding 64 columns of a wider matrix.
#pragma once

typedef unsigned short wg_half;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ unsigned wg_smem(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// 16 bytes global -> shared, asynchronously; ok = false writes zeros and reads nothing
__device__ __forceinline__ void wg_cp16(unsigned dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(ok ? 16 : 0));
}

// a K-major operand of 128-byte rows in 128-byte swizzle: leading offset unused (1), 1024 bytes between
// 8-row groups, swizzle mode 1 (bits 62-63)
__device__ __forceinline__ unsigned long long wg_desc(unsigned addr) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

// an MN-major operand (the B of a wgmma with imm-trans-b = 1) in the same rows: each 128-byte row holds 64
// consecutive MN (output column) values of one k, 8 k-rows make a 1024-byte atom, the next 8 k-rows are the
// next atom (stride 1024 bytes), and the next 64 MN values are `panel` bytes on (the leading offset). In
// CUTLASS's words (uint128_t units): Swizzle<3,4,3> o ((8,n),(8,k)):((1,LBO),(8,SBO)), LBO = panel, SBO = 1024.
__device__ __forceinline__ unsigned long long wg_desc_mn(unsigned addr, unsigned panel) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)((panel >> 4) & 0x3FFF) << 16) |
           (64ull << 32) | (1ull << 62);
}

// The accumulators of a wgmma m64nNk16 as inline-asm operands (fp32, N / 2 registers a thread: 32 for n64, 128 for
// n256): WG_ACC32(d) / WG_ACC128(d) list "+f"(d[0]) .. as the asm's first operands, WG_ACC32_NAMES /
// WG_ACC128_NAMES name them (%0 ..) in its text; its other operands are then %32 (%128) on.
#define WG_ACC32_NAMES                                                                                              \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                        \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WG_ACC128_NAMES                                                                                             \
    WG_ACC32_NAMES ", "                                                                                             \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                              \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "                              \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "                              \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "                              \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "                  \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define WG_ACC4(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define WG_ACC16(d, i) WG_ACC4(d, i), WG_ACC4(d, i + 4), WG_ACC4(d, i + 8), WG_ACC4(d, i + 12)
#define WG_ACC32(d) WG_ACC16(d, 0), WG_ACC16(d, 16)
#define WG_ACC128(d)                                                                                                \
    WG_ACC16(d, 0), WG_ACC16(d, 16), WG_ACC16(d, 32), WG_ACC16(d, 48), WG_ACC16(d, 64), WG_ACC16(d, 80),            \
        WG_ACC16(d, 96), WG_ACC16(d, 112)

// keeps the compiler from moving accesses of the accumulators across the asynchronous MMAs
template <int R>
__device__ __forceinline__ void wg_fence_acc(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
#endif
