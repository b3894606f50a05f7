// Minimal fp16 tensor-core fragments for sm_70+ written directly in PTX (wmma.* m16n16k16), and the warp / block
// reductions the kernels share.
//
// No numpy twin: this is the building block of gemm.cu and attention.cu. NVRTC from pip ships neither
// <mma.h> nor <cuda_fp16.h>, so everything here is inline PTX that every architecture from sm_70 on accepts.
// Fragment layouts are opaque (as in nvcuda::wmma) but identical for two fragments of the same kind, which
// the kernels use: element t of two accumulators refers to the same (row, col).
#pragma once

typedef unsigned short half_t;   // IEEE fp16 bits
#define CLEF_INF __int_as_float(0x7f800000)

__device__ __forceinline__ half_t f2h(float f) {
    half_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float h2f(half_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ unsigned pack2h(float a, float b) {   // a in the low half
    return (unsigned)f2h(a) | ((unsigned)f2h(b) << 16);
}
// bf16 bits -> fp32 (exact)
__device__ __forceinline__ float bf2f(unsigned short b) { return __uint_as_float(((unsigned)b) << 16); }
// SiLU as every fused SwiGLU computes it (gemm.cu epilogues, fp8.cu swiglu_amax)
__device__ __forceinline__ float silu_f(float x) { return x / (1.f + __expf(-x)); }

struct FragA { unsigned x[8]; };
struct FragB { unsigned x[8]; };
struct FragC { float x[8]; };

__device__ __forceinline__ void frag_zero(FragC& c) {
#pragma unroll
    for (int i = 0; i < 8; ++i) c.x[i] = 0.f;
}

#define CLEF_LOAD8(kind, layout, f, p, ld)                                                        \
    asm volatile("wmma.load." kind ".sync.aligned." layout ".m16n16k16.f16 "                      \
                 "{%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;"                                           \
                 : "=r"(f.x[0]), "=r"(f.x[1]), "=r"(f.x[2]), "=r"(f.x[3]), "=r"(f.x[4]),          \
                   "=r"(f.x[5]), "=r"(f.x[6]), "=r"(f.x[7])                                       \
                 : "l"(p), "r"(ld))

// A (16x16, row-major, ld in elements)
__device__ __forceinline__ void load_a_row(FragA& f, const half_t* p, unsigned ld) { CLEF_LOAD8("a", "row", f, p, ld); }
// B (16x16) stored column-major: B(k, n) at p[n * ld + k]
__device__ __forceinline__ void load_b_col(FragB& f, const half_t* p, unsigned ld) { CLEF_LOAD8("b", "col", f, p, ld); }
// B (16x16) stored row-major: B(k, n) at p[k * ld + n]
__device__ __forceinline__ void load_b_row(FragB& f, const half_t* p, unsigned ld) { CLEF_LOAD8("b", "row", f, p, ld); }
#undef CLEF_LOAD8

#define CLEF_MMA(layout, d, a, b)                                                                 \
    asm volatile("wmma.mma.sync.aligned." layout ".m16n16k16.f32.f32 "                            \
                 "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11,%12,%13,%14,%15}, "                   \
                 "{%16,%17,%18,%19,%20,%21,%22,%23}, {%0,%1,%2,%3,%4,%5,%6,%7};"                  \
                 : "+f"(d.x[0]), "+f"(d.x[1]), "+f"(d.x[2]), "+f"(d.x[3]), "+f"(d.x[4]),          \
                   "+f"(d.x[5]), "+f"(d.x[6]), "+f"(d.x[7])                                       \
                 : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "r"(a.x[4]), "r"(a.x[5]),   \
                   "r"(a.x[6]), "r"(a.x[7]), "r"(b.x[0]), "r"(b.x[1]), "r"(b.x[2]), "r"(b.x[3]),   \
                   "r"(b.x[4]), "r"(b.x[5]), "r"(b.x[6]), "r"(b.x[7]))

// d += a (row) * b (col)
__device__ __forceinline__ void mma_row_col(FragC& d, const FragA& a, const FragB& b) { CLEF_MMA("row.col", d, a, b); }
// d += a (row) * b (row)
__device__ __forceinline__ void mma_row_row(FragC& d, const FragA& a, const FragB& b) { CLEF_MMA("row.row", d, a, b); }
// d += a (col) * b (row)
__device__ __forceinline__ void mma_col_row(FragC& d, const FragA& a, const FragB& b) { CLEF_MMA("col.row", d, a, b); }
#undef CLEF_MMA

// fp32 accumulator <-> memory, row-major, ld in elements (multiple of 4)
__device__ __forceinline__ void store_c_row(float* p, const FragC& c, unsigned ld) {
    asm volatile("wmma.store.d.sync.aligned.row.m16n16k16.f32 [%0], {%1,%2,%3,%4,%5,%6,%7,%8}, %9;"
                 :: "l"(p), "f"(c.x[0]), "f"(c.x[1]), "f"(c.x[2]), "f"(c.x[3]), "f"(c.x[4]),
                    "f"(c.x[5]), "f"(c.x[6]), "f"(c.x[7]), "r"(ld) : "memory");
}
__device__ __forceinline__ void load_c_row(FragC& c, const float* p, unsigned ld) {
    asm volatile("wmma.load.c.sync.aligned.row.m16n16k16.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;"
                 : "=f"(c.x[0]), "=f"(c.x[1]), "=f"(c.x[2]), "=f"(c.x[3]), "=f"(c.x[4]),
                   "=f"(c.x[5]), "=f"(c.x[6]), "=f"(c.x[7])
                 : "l"(p), "r"(ld));
}

// The same fragment loads/stores with a .shared address (a 32-bit offset in the shared window): sm_75+ turns
// them into ldmatrix, where a generic-address wmma load is 8 scalar loads.
__device__ __forceinline__ unsigned sa(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
#define CLEF_LOADS(name, frag, spec)                                                                    \
    __device__ __forceinline__ void name(frag& f, unsigned a, unsigned ld) {                          \
        asm volatile("wmma.load." spec ".m16n16k16.shared.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;"    \
                     : "=r"(f.x[0]), "=r"(f.x[1]), "=r"(f.x[2]), "=r"(f.x[3]), "=r"(f.x[4]),          \
                       "=r"(f.x[5]), "=r"(f.x[6]), "=r"(f.x[7])                                       \
                     : "r"(a), "r"(ld));                                                               \
    }
// a: A(m, k) at row m (row) or column m (col); b: B(k, n) at row k (row) or column n (col); ld in halves
CLEF_LOADS(lda_row, FragA, "a.sync.aligned.row")
CLEF_LOADS(lda_col, FragA, "a.sync.aligned.col")
CLEF_LOADS(ldb_row, FragB, "b.sync.aligned.row")
CLEF_LOADS(ldb_col, FragB, "b.sync.aligned.col")
#undef CLEF_LOADS
// fp32 accumulator -> shared memory, row-major, ld in elements (multiple of 4)
__device__ __forceinline__ void stc_row(unsigned a, const FragC& c, unsigned ld) {
    asm volatile("wmma.store.d.sync.aligned.row.m16n16k16.shared.f32 [%0], {%1,%2,%3,%4,%5,%6,%7,%8}, %9;"
                 :: "r"(a), "f"(c.x[0]), "f"(c.x[1]), "f"(c.x[2]), "f"(c.x[3]), "f"(c.x[4]), "f"(c.x[5]),
                    "f"(c.x[6]), "f"(c.x[7]), "r"(ld) : "memory");
}

// reduction ops for warp_reduce / block_reduce
struct OpAdd { template <typename T> __device__ T operator()(T a, T b) const { return a + b; } };
struct OpMax { __device__ float operator()(float a, float b) const { return fmaxf(a, b); } };

// v combined over the 32 lanes of a warp by op (a butterfly: every lane ends with the result)
template <typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// v combined over the block (blockDim.x a multiple of 32) by op, a sum or a max with 0 as its identity (counts,
// amax of magnitudes); the result is in every lane of warp 0, which the callers use for one atomic per block.
// Ends with a barrier so that a second call may reuse red[]: call it from every thread of the block.
template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, Op op) {
    __shared__ T red[32];
    v = warp_reduce(v, op);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    if (warp == 0) v = warp_reduce(lane < (int)(blockDim.x >> 5) ? red[lane] : T(0), op);
    __syncthreads();
    return v;
}
