// fp8 e4m3 ("fn" flavour: largest finite 448, no infinities) operands for the split8 GEMM path: an fp32
// activation x = hi + lo enters cuBLAS as hi in fp16 against the fp16 weight and as lo in fp8 against an fp8
// twin of the weight (fp8 tensor cores, sm_89+). lo is at most 2^-11 |x|, so the fp8 rounding of lo and of the
// weight costs about 2^-11 * 2^-4 of the product: far below the single fp16 rounding it repairs.
//
// numpy twin: clefcore/backends/cpu.py::linear, the fp32 product the split8 GEMM reproduces; the rounding itself
// (nearest even, saturating at 448) is checked against ml_dtypes.float8_e4m3fn in tests/test_kernels.py.
// Scales are powers of two (exact): a tensor whose largest magnitude is m is multiplied by 2^floor(log2(448/m))
// before rounding, and cuBLASLt multiplies the product by the inverse (its A/B scale pointers). The activation's
// scale stays on the device (no host round trip, so a CUDA graph can hold the whole GEMM).
// Software rounding, so the same code builds for sm_70 (where the fp8 GEMM never runs) and is tested anywhere.
#include "mma_sm70.cuh"

__device__ __forceinline__ unsigned char e4m3(float v) {
    const unsigned sign = (__float_as_uint(v) >> 24) & 0x80u;
    const float a = fabsf(v);
    unsigned code;
    if (a < 0.015625f) {                      // below 2^-6: subnormal steps of 2^-9 (code 8 is 2^-6 itself)
        code = (unsigned)__float2int_rn(a * 512.f);
    } else {                                  // 8 exponent + 3 mantissa bits, rounded half to even; a mantissa
        const unsigned u = __float_as_uint(a);    // carry rolls into the exponent; rebias 127 -> 7
        const unsigned keep = u >> 20, rem = u & 0xFFFFFu;
        code = keep + (rem > 0x80000u || (rem == 0x80000u && (keep & 1u))) - ((127u - 7u) << 3);
    }
    return (unsigned char)(sign | min(code, 126u));   // 126 = 448; 127 would be NaN
}

// 2^floor(log2(448 / m)) for m > 0 (1 for m = 0), kept inside the normal fp32 range
__device__ __forceinline__ float e4m3_scale(float m) {
    return m > 0.f ? ldexpf(1.f, max(-126, min(126, ilogbf(448.f / m)))) : 1.f;
}

__device__ __forceinline__ float lo_abs(float v) { return fabsf(v - h2f(f2h(v))); }

// amax[0] = max over the block's threads of m (as fp32 bits: non-negative floats order like their bits; amax
// starts at 0), reduced in the block first: one atomic per block, not per warp (a per-warp atomic on one
// address took longer than the pass itself).
__device__ __forceinline__ void block_amax(float m, unsigned* __restrict__ amax) {
    m = block_reduce(m, OpMax());
    if (threadIdx.x == 0) atomicMax(amax, __float_as_uint(m));
}

__device__ __forceinline__ float lo_amax4(const float4 v, float m) {
    return fmaxf(fmaxf(lo_abs(v.x), lo_abs(v.y)), fmaxf(fmaxf(lo_abs(v.z), lo_abs(v.w)), m));
}

// amax[0] = max |x - fp16(x)| over n4 float4s; a few blocks per SM (grid-stride).
extern "C" __global__ void lo_amax(const float4* __restrict__ x, long long n4, unsigned* __restrict__ amax) {
    float m = 0.f;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n4; i += (long long)gridDim.x * blockDim.x)
        m = lo_amax4(x[i], m);
    block_amax(m, amax);
}

// The MLP's hidden activation on the split paths: g <- silu(g) * u in place (no third [M, I] buffer). With amax
// (split8's down projection) also amax[0] = max |h - fp16(h)| from the same pass, so that split_fp8 follows
// without lo_amax's second read of h; amax null: the split path, nothing reduced. Float4s, then a scalar tail
// (any n; 16-byte aligned arrays).
extern "C" __global__ void swiglu_inplace(const float* __restrict__ u, float* __restrict__ g, long long n,
                                          unsigned* __restrict__ amax) {
    float m = 0.f;
    const long long i0 = blockIdx.x * (long long)blockDim.x + threadIdx.x, step = (long long)gridDim.x * blockDim.x;
    for (long long i = i0; i < n / 4; i += step) {
        const float4 a = ((const float4*)g)[i], b = ((const float4*)u)[i];
        const float4 h = make_float4(silu_f(a.x) * b.x, silu_f(a.y) * b.y, silu_f(a.z) * b.z, silu_f(a.w) * b.w);
        ((float4*)g)[i] = h;
        m = lo_amax4(h, m);
    }
    for (long long i = n / 4 * 4 + i0; i < n; i += step) {
        const float h = silu_f(g[i]) * u[i];
        g[i] = h;
        m = fmaxf(m, lo_abs(h));
    }
    if (amax) block_amax(m, amax);   // uniform over the block: its __syncthreads is safe
}

// hi = fp16(x); lo8 = e4m3((x - hi) * s) with s = e4m3_scale(amax); inv[0] = 1 / s (cuBLASLt's scale for lo8).
// Four values per thread (n4 float4s; 16-byte aligned arrays, checked by the caller).
extern "C" __global__ void split_fp8(const float4* __restrict__ x, uint2* __restrict__ hi, unsigned* __restrict__ lo8,
                                     long long n4, const unsigned* __restrict__ amax, float* __restrict__ inv) {
    const float s = e4m3_scale(__uint_as_float(amax[0]));
    if (blockIdx.x == 0 && threadIdx.x == 0) inv[0] = 1.f / s;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n4; i += (long long)gridDim.x * blockDim.x) {
        const float4 v = x[i];
        const half_t h0 = f2h(v.x), h1 = f2h(v.y), h2 = f2h(v.z), h3 = f2h(v.w);
        hi[i] = make_uint2((unsigned)h0 | ((unsigned)h1 << 16), (unsigned)h2 | ((unsigned)h3 << 16));
        lo8[i] = (unsigned)e4m3((v.x - h2f(h0)) * s) | ((unsigned)e4m3((v.y - h2f(h1)) * s) << 8) |
                 ((unsigned)e4m3((v.z - h2f(h2)) * s) << 16) | ((unsigned)e4m3((v.w - h2f(h3)) * s) << 24);
    }
}

// a weight's fp8 twin: w8 = e4m3(w * s), s chosen by the host from the weight's largest magnitude (at load)
extern "C" __global__ void half_to_e4m3(const half_t* __restrict__ w, unsigned char* __restrict__ w8, long long n,
                                        float s) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        w8[i] = e4m3(h2f(w[i]) * s);
}

// the rounding alone, for the test against the numpy twin
extern "C" __global__ void f32_to_e4m3(const float* __restrict__ x, unsigned char* __restrict__ y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = e4m3(x[i]);
}
