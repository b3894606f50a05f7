// Hopper (sm_90a) building blocks shared by the warpgroup-MMA kernels (gemm_wgmma.cu, attention_wgmma.cu): the
// shared-memory address of a pointer, the zero-filling 16-byte cp.async, the matrix descriptors of operands laid
// out in 128-byte-swizzled rows, and the compiler fence that pins register accesses after a wgmma wait.
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

// keeps the compiler from moving accesses of the accumulators across the asynchronous MMAs
template <int R>
__device__ __forceinline__ void wg_fence_acc(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
#endif
