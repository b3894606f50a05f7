// Tile helpers of the delta-rule kernels (gated_delta.cu, gated_delta_wy.cu): fp32 values to fp16 hi + lo
// halves, chunk rows with a zero tail, an accumulator tile read row by row through a warp's staging.
//
// No numpy twin: building blocks of the kernels that include it.
#pragma once
#include "mma_sm70.cuh"

__device__ __forceinline__ unsigned hl_pair(float a, float b, unsigned& lo) {   // hi halves returned
    const half_t ha = f2h(a), hb = f2h(b);
    lo = pack2h(a - h2f(ha), b - h2f(hb));
    return (unsigned)ha | ((unsigned)hb << 16);
}
// 8 consecutive fp32 -> 8 hi and 8 lo halves (16-byte aligned destinations)
__device__ __forceinline__ void store8_hl(half_t* hi, half_t* lo, const float* x) {
    unsigned h[4], l[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = hl_pair(x[2 * i], x[2 * i + 1], l[i]);
    *(uint4*)hi = make_uint4(h[0], h[1], h[2], h[3]);
    *(uint4*)lo = make_uint4(l[0], l[1], l[2], l[3]);
}
// 8 consecutive fp32 -> 8 halves (the hi halves alone; 16-byte aligned destination)
__device__ __forceinline__ void store8_h(half_t* hi, const float* x) {
    *(uint4*)hi = make_uint4(pack2h(x[0], x[1]), pack2h(x[2], x[3]), pack2h(x[4], x[5]), pack2h(x[6], x[7]));
}
__device__ __forceinline__ void store4_hl(half_t* hi, half_t* lo, float4 x) {
    unsigned l0, l1;
    const unsigned h0 = hl_pair(x.x, x.y, l0), h1 = hl_pair(x.z, x.w, l1);
    *(uint2*)hi = make_uint2(h0, h1);
    *(uint2*)lo = make_uint2(l0, l1);
}
// row r (< 64) of a chunk's rows at p (row stride ld floats) as a float4; rows past n (>= 1) read row n - 1 and
// give zeros, so the load needs no branch and the loads of an unrolled loop are issued together
__device__ __forceinline__ float4 chunk_row4(const float* p, int r, int n, int ld) {
    const float4 v = *(const float4*)(p + min(r, n - 1) * ld);
    return r < n ? v : make_float4(0.f, 0.f, 0.f, 0.f);
}
// an accumulator tile through the warp's 16x16 fp32 staging: the lane gets row lane/2, columns 8*(lane&1) + 0..7
__device__ __forceinline__ void tile_to_lane(float* stage, const FragC& c, float (&x)[8]) {
    stc_row(sa(stage), c, 16);
    __syncwarp();
    const int lane = threadIdx.x & 31;
    const float4 a = *(const float4*)(stage + (lane >> 1) * 16 + (lane & 1) * 8);
    const float4 b = *(const float4*)(stage + (lane >> 1) * 16 + (lane & 1) * 8 + 4);
    x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w; x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
    __syncwarp();
}
