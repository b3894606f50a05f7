// Tensor-core GEMM: C[M, N] (fp32) = A[M, K] @ W[N, K]^T with fp16 operands and fp32 accumulation.
//
// numpy twins: clefcore/backends/cpu.py::linear (plain, + bias, + residual) and
//              clefcore/backends/cpu.py::mlp (SWIGLU epilogue: silu(A Wg^T) * (A Wu^T), written as fp16
//              because it is only ever the A operand of the down projection).
//
// sm_70 design (docs/sm70-design.md): block tile 128 x 128 x 32, 256 threads = 8 warps in a 2 x 4 grid,
// each warp 64 x 32 (4 x 2 wmma m16n16k16 accumulators, 64 fp32 registers). The next k-tile is loaded into
// registers while the tensor cores work on the current one (one shared buffer, 20 KB, rows padded by
// 8 halves so wmma row loads hit distinct banks). A may be fp32 (converted to fp16 while it is staged) or
// fp16. The epilogue goes through a 1 KB per-warp shared tile so edges of any M, N are written exactly.
#include "mma_sm70.cuh"
#include "range.cuh"

#define GM 128
#define GN 128
#define GK 32
#define GLD (GK + 8)

// 16 consecutive halves of one row (from column gk), packed in pairs; zeros past the row's end or for a row
// outside the matrix (ok = false). vec: K % 16 == 0, so a full 16-half run is one aligned 32-byte read.
__device__ __forceinline__ void load16h(const half_t* __restrict__ X, bool ok, size_t row, int gk, int K, bool vec,
                                        unsigned (&r)[8]) {
    if (vec && ok && gk + 16 <= K) {
        const uint4* p = (const uint4*)(X + row + gk);
        const uint4 a = p[0], b = p[1];
        r[0] = a.x; r[1] = a.y; r[2] = a.z; r[3] = a.w; r[4] = b.x; r[5] = b.y; r[6] = b.z; r[7] = b.w;
        return;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        half_t lo = 0, hi = 0;
        if (ok && gk + 2 * i < K) lo = X[row + gk + 2 * i];
        if (ok && gk + 2 * i + 1 < K) hi = X[row + gk + 2 * i + 1];
        r[i] = (unsigned)lo | ((unsigned)hi << 16);
    }
}

// two fp32 values -> one packed fp16 pair (h); SPLIT: also the pair of what the rounding lost (l), so h + l
// carries ~22 significant bits
template <bool SPLIT>
__device__ __forceinline__ void pack_pair(float a, float b, unsigned& h, unsigned& l, float s) {
    if (SPLIT) { a *= s; b *= s; }   // range scaling (range.cuh); s = 1 in every normal run
    h = pack2h(a, b);
    if (SPLIT) l = pack2h(a - h2f((half_t)(h & 0xffff)), b - h2f((half_t)(h >> 16)));
}

template <bool AH, bool SPLIT>
__device__ __forceinline__ void load_tile(const void* __restrict__ Av, const half_t* __restrict__ Wg,
                                          const half_t* __restrict__ Wu, int M, int N, int K, int m0, int n0,
                                          int k0, bool swiglu, bool vec, float s, unsigned (&ra)[8],
                                          unsigned (&rl)[8], unsigned (&rb)[8]) {
    const int t = threadIdx.x;
    // A: 128 rows x 32 k = 4096 values, 16 per thread: row = t / 2, k-part = (t % 2) * 16
    {
        const int r = t >> 1, kk = (t & 1) * 16, gr = m0 + r, gk = k0 + kk;
        if (AH) {
            load16h((const half_t*)Av, gr < M, (size_t)gr * K, gk, K, vec, ra);
        } else {
            const float* A = (const float*)Av;
            if (vec && gr < M && gk + 16 <= K) {
                const float4* p = (const float4*)(A + (size_t)gr * K + gk);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float4 v = p[i];
                    pack_pair<SPLIT>(v.x, v.y, ra[2 * i], rl[2 * i], s);
                    pack_pair<SPLIT>(v.z, v.w, ra[2 * i + 1], rl[2 * i + 1], s);
                }
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    float lo = 0.f, hi = 0.f;
                    if (gr < M && gk + 2 * i < K) lo = A[(size_t)gr * K + gk + 2 * i];
                    if (gr < M && gk + 2 * i + 1 < K) hi = A[(size_t)gr * K + gk + 2 * i + 1];
                    pack_pair<SPLIT>(lo, hi, ra[i], rl[i], s);
                }
            }
        }
    }
    // W: 128 rows x 32 k, 16 halves per thread like A
    {
        const int r = t >> 1, kk = (t & 1) * 16, gk = k0 + kk;
        const half_t* W;
        int gn;
        if (swiglu) { W = r < 64 ? Wg : Wu; gn = n0 + (r & 63); }
        else { W = Wg; gn = n0 + r; }
        load16h(W, gn < N, (size_t)gn * K, gk, K, vec, rb);
    }
}

// N here is the number of OUTPUT columns; in SWIGLU mode Wg and Wu both have N rows.
template <bool AH, bool SWIGLU, bool SPLIT>
__device__ __forceinline__ void gemm_body(const void* __restrict__ A, const half_t* __restrict__ Wg,
                                          const half_t* __restrict__ Wu, const float* __restrict__ bias,
                                          const float* __restrict__ res, void* __restrict__ C, int M, int N, int K,
                                          const unsigned* __restrict__ amax) {
    __shared__ __align__(32) half_t sA[GM * GLD];
    __shared__ __align__(32) half_t sB[GN * GLD];
    __shared__ __align__(32) half_t sL[SPLIT ? GM * GLD : 16];   // low halves of A (SPLIT: A = hi + lo)
    const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
    const int wm = warp >> 2, wn = warp & 3;
    const int m0 = blockIdx.y * GM;
    const int n0 = blockIdx.x * (SWIGLU ? GN / 2 : GN);
    const bool vec = (K % 16) == 0;
    FragC acc[4][2];
#pragma unroll
    for (int i = 0; i < 4; ++i) { frag_zero(acc[i][0]); frag_zero(acc[i][1]); }
    const int shift = SPLIT ? range_shift(amax) : 0;
    const float s_in = ldexpf(1.f, -shift);
    unsigned ra[8], rl[8], rb[8];
    load_tile<AH, SPLIT>(A, Wg, Wu, M, N, K, m0, n0, 0, SWIGLU, vec, s_in, ra, rl, rb);
    for (int k0 = 0; k0 < K; k0 += GK) {
        {
            const int r = t >> 1, kk = (t & 1) * 16;
            uint4* pa = (uint4*)(sA + r * GLD + kk);
            pa[0] = make_uint4(ra[0], ra[1], ra[2], ra[3]);
            pa[1] = make_uint4(ra[4], ra[5], ra[6], ra[7]);
            if (SPLIT) {
                uint4* pl = (uint4*)(sL + r * GLD + kk);
                pl[0] = make_uint4(rl[0], rl[1], rl[2], rl[3]);
                pl[1] = make_uint4(rl[4], rl[5], rl[6], rl[7]);
            }
            uint4* pb = (uint4*)(sB + r * GLD + kk);
            pb[0] = make_uint4(rb[0], rb[1], rb[2], rb[3]);
            pb[1] = make_uint4(rb[4], rb[5], rb[6], rb[7]);
        }
        __syncthreads();
        if (k0 + GK < K) load_tile<AH, SPLIT>(A, Wg, Wu, M, N, K, m0, n0, k0 + GK, SWIGLU, vec, s_in, ra, rl, rb);
#pragma unroll
        for (int ks = 0; ks < GK; ks += 16) {
            FragA fa[4];
            FragB fb[2];
#pragma unroll
            for (int i = 0; i < 4; ++i) load_a_row(fa[i], sA + (wm * 64 + i * 16) * GLD + ks, GLD);
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int brow = SWIGLU ? (j * 64 + wn * 16) : (wn * 32 + j * 16);
                load_b_col(fb[j], sB + brow * GLD + ks, GLD);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                mma_row_col(acc[i][0], fa[i], fb[0]);
                mma_row_col(acc[i][1], fa[i], fb[1]);
            }
            if (SPLIT) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    load_a_row(fa[i], sL + (wm * 64 + i * 16) * GLD + ks, GLD);
                    mma_row_col(acc[i][0], fa[i], fb[0]);
                    mma_row_col(acc[i][1], fa[i], fb[1]);
                }
            }
        }
        __syncthreads();
    }
    // epilogue through a per-warp 16 x 16 fp32 tile (reuses sA)
    float* stage = (float*)sA + warp * 256;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < (SWIGLU ? 1 : 2); ++j) {
            if (SPLIT && shift) {
                const float s_out = ldexpf(1.f, shift);
#pragma unroll
                for (int e = 0; e < 8; ++e) { acc[i][j].x[e] *= s_out; if (SWIGLU) acc[i][1].x[e] *= s_out; }
            }
            if (SWIGLU) {
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[i][0].x[e] = silu_f(acc[i][0].x[e]) * acc[i][1].x[e];
            }
            store_c_row(stage, acc[i][j], 16);
            __syncwarp();
            const int r = lane >> 1, c0 = (lane & 1) * 8;
            const int gr = m0 + wm * 64 + i * 16 + r;
            const int gc0 = n0 + (SWIGLU ? wn * 16 : wn * 32 + j * 16) + c0;
            if (gr < M) {
#pragma unroll
                for (int c = 0; c < 8; ++c) {
                    const int gc = gc0 + c;
                    if (gc < N) {
                        float v = stage[r * 16 + c0 + c];
                        if (SWIGLU) {
                            if (SPLIT) ((float*)C)[(size_t)gr * N + gc] = v;
                            else ((half_t*)C)[(size_t)gr * N + gc] = f2h(v);
                        } else {
                            if (bias) v += bias[gc];
                            if (res) v += res[(size_t)gr * N + gc];
                            ((float*)C)[(size_t)gr * N + gc] = v;
                        }
                    }
                }
            }
            __syncwarp();
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) gemm_f32a(const float* A, const half_t* W, const float* bias,
                                                           const float* res, float* C, int M, int N, int K) {
    gemm_body<false, false, false>(A, W, W, bias, res, C, M, N, K, nullptr);
}
extern "C" __global__ void __launch_bounds__(256) gemm_f16a(const half_t* A, const half_t* W, const float* bias,
                                                           const float* res, float* C, int M, int N, int K) {
    gemm_body<true, false, false>(A, W, W, bias, res, C, M, N, K, nullptr);
}
extern "C" __global__ void __launch_bounds__(256) gemm_swiglu_f32a(const float* A, const half_t* Wg,
                                                                  const half_t* Wu, half_t* H, int M, int N, int K) {
    gemm_body<false, true, false>(A, Wg, Wu, nullptr, nullptr, H, M, N, K, nullptr);
}
// A already fp16 (its producer rounded it: the fused_elementwise switch); the same products as gemm_swiglu_f32a's,
// which rounds each A value to the same fp16 while staging it
extern "C" __global__ void __launch_bounds__(256) gemm_swiglu_f16a(const half_t* A, const half_t* Wg,
                                                                  const half_t* Wu, half_t* H, int M, int N, int K) {
    gemm_body<true, true, false>(A, Wg, Wu, nullptr, nullptr, H, M, N, K, nullptr);
}
// precision="split": A = hi + lo (two fp16 halves, ~22 significant bits), two tensor-core passes; with
// fp16-exact weights (every bf16 checkpoint value in fp16 range) the product is fp32-grade. amax: range scaling
// (range.cuh), null outside the range-safe fallback.
extern "C" __global__ void __launch_bounds__(256) gemm_f32a_split(const float* A, const half_t* W, const float* bias,
                                                                 const float* res, float* C, int M, int N, int K,
                                                                 const unsigned* amax) {
    gemm_body<false, false, true>(A, W, W, bias, res, C, M, N, K, amax);
}
extern "C" __global__ void __launch_bounds__(256) gemm_swiglu_f32a_split(const float* A, const half_t* Wg,
                                                                        const half_t* Wu, float* H, int M, int N,
                                                                        int K, const unsigned* amax) {
    gemm_body<false, true, true>(A, Wg, Wu, nullptr, nullptr, H, M, N, K, amax);
}
// The split precision's cuBLAS operand: hi = fp16(x), lo = fp16(x - hi). When n % 4 == 0 (lo, n halves after
// hi, is then 8-byte aligned) a thread takes four values: one 16-byte load and two 8-byte stores (the one-value
// loop moved 2.2 TB/s on the H200); otherwise one value per thread.
__device__ __forceinline__ unsigned lo_pair(float a, float b) {
    return pack2h(a - h2f(f2h(a)), b - h2f(f2h(b)));
}
extern "C" __global__ void to_half_split(const float* __restrict__ x, half_t* __restrict__ hi,
                                         half_t* __restrict__ lo, long long n, const unsigned* __restrict__ amax) {
    const long long t = blockIdx.x * (long long)blockDim.x + threadIdx.x, step = (long long)gridDim.x * blockDim.x;
    const float s = ldexpf(1.f, -range_shift(amax));   // range scaling (range.cuh): 1 in every normal run
    if ((n & 3) == 0) {
        for (long long i = t; i < n / 4; i += step) {
            float4 v = ((const float4*)x)[i];
            v.x *= s; v.y *= s; v.z *= s; v.w *= s;
            ((uint2*)hi)[i] = make_uint2(pack2h(v.x, v.y), pack2h(v.z, v.w));
            ((uint2*)lo)[i] = make_uint2(lo_pair(v.x, v.y), lo_pair(v.z, v.w));
        }
    } else {
        for (long long i = t; i < n; i += step) {
            const float v = x[i] * s;
            const half_t h = f2h(v);
            hi[i] = h;
            lo[i] = f2h(v - h2f(h));
        }
    }
}
// The range-safe fallback's two passes around a cuBLAS split GEMM: amax[0] = max |x| (fp32 bits; amax starts at
// 0; one atomic per block), and y *= 2^shift afterwards (every block returns at once when nothing was scaled).
extern "C" __global__ void abs_amax(const float* __restrict__ x, long long n, unsigned* __restrict__ amax) {
    float m = 0.f;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        m = fmaxf(m, fabsf(x[i]));
    m = block_reduce(m, OpMax());
    if (threadIdx.x == 0) atomicMax(amax, __float_as_uint(m));
}
extern "C" __global__ void range_rescale(float* __restrict__ y, long long n, const unsigned* __restrict__ amax) {
    const int shift = range_shift(amax);
    if (!shift) return;
    const float s = ldexpf(1.f, shift);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] *= s;
}
// fp32 -> fp16 (activations entering cuBLAS) and silu(g) * u -> fp16 (cuBLAS MLP path; the split paths' in-place
// SwiGLU is fp8.cu's swiglu_inplace).
extern "C" __global__ void to_half(const float* __restrict__ x, half_t* __restrict__ y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = f2h(x[i]);
}
extern "C" __global__ void swiglu_half(const float* __restrict__ g, const float* __restrict__ u,
                                       half_t* __restrict__ y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = f2h(silu_f(g[i]) * u[i]);
}
// checkpoint weights -> fp16, counting values whose magnitude does not fit fp16 (|x| > 65504: saturated) and
// nonzero values that flush to zero (|x| < 2^-24). Sources: fp32, or bf16 bits (widened exactly first).
__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ float widen(unsigned short b) { return bf2f(b); }

template <typename T>
__device__ __forceinline__ void to_half_counted(const T* __restrict__ x, half_t* __restrict__ y, long long n,
                                                unsigned long long* __restrict__ counts) {
    unsigned long long over = 0, under = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float v = widen(x[i]);
        const float a = fabsf(v);
        if (a > 65504.f && a == a) { over++; v = copysignf(65504.f, v); }
        else if (a != 0.f && a < 5.9604645e-8f) under++;
        y[i] = f2h(v);
    }
    if (over) atomicAdd(counts, over);
    if (under) atomicAdd(counts + 1, under);
}
extern "C" __global__ void f32_to_half_count(const float* __restrict__ x, half_t* __restrict__ y, long long n,
                                             unsigned long long* __restrict__ counts) {
    to_half_counted(x, y, n, counts);
}
extern "C" __global__ void bf16_to_half_count(const unsigned short* __restrict__ x, half_t* __restrict__ y,
                                              long long n, unsigned long long* __restrict__ counts) {
    to_half_counted(x, y, n, counts);
}
