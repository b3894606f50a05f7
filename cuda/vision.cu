// The vision tower's memory-bound kernels (clefcore/model/vision.py): its input rows made on the GPU from the resized
// uint8 image, the q/k/v preparation of its attention, and its MLP's bias + tanh GELU. Each is one read and one
// write of its data, and replaces two to five separate passes (a 25 MB host array and its upload for the input).
//
// numpy twins: clefcore/backends/cpu.py::patch_rows (clefcore/preprocess.py::patch_values per image),
//              clefcore/backends/cpu.py::vision_attention (the bias, the 2-D RoPE of q and k: cpu.py::rotary),
//              clefcore/backends/cpu.py::vision_mlp and clefcore/backends/cpu.py::gelu_tanh.
#include "mma_sm70.cuh"

#define GRID_STRIDE(e, n)                                                                      \
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < (n);                \
         e += (long long)gridDim.x * blockDim.x)

// patch_rows: one image img [16 gh, 16 gw, 3] uint8 -> out [gh gw, 1536] fp32 in merge-block order (2 x 2 patches
// of a merged token consecutive), each row [channel][temporal 2][16 y][16 x]: the one frame in both temporal
// slots, each level k as (k - 127.5) / 127.5 (IEEE division, as numpy's fp32 table). A thread per (row,
// channel, y, x) writes both slots.
extern "C" __global__ void patch_rows(const unsigned char* __restrict__ img, int gh, int gw,
                                      float* __restrict__ out) {
    const long long n = (long long)gh * gw * 768;
    const int W = gw * 16, bw_n = gw / 2;
    GRID_STRIDE(e, n) {
        const int within = (int)(e % 768), c = within / 256, yx = within % 256;
        const long long r = e / 768, blk = r >> 2;
        const int mh = (int)(r >> 1) & 1, mw = (int)r & 1;
        const int Y = ((int)(blk / bw_n) * 2 + mh) * 16 + yx / 16, X = ((int)(blk % bw_n) * 2 + mw) * 16 + yx % 16;
        const float v = ((float)img[((long long)Y * W + X) * 3 + c] - 127.5f) / 127.5f;
        float* o = out + r * 1536 + c * 512 + yx;
        o[0] = v;
        o[256] = v;
    }
}

// qkv_rope: the attention's inputs from the fused projection qkv [n, 3, H, D] fp32 (without its bias): q and k
// with the bias added and the 2-D RoPE applied (NeoX half split over all D: x1 c - x2 s, x2 c + x1 s, cos/sin
// [n, D/2]), v with its bias; written [n, H, D] each: fp16 by qkv_rope_half (the attention kernel's operands,
// fast path), fp32 by qkv_rope_f32 (the exact modes' fp32 attention).
template <typename T> __device__ __forceinline__ T store_as(float v);
template <> __device__ __forceinline__ float store_as<float>(float v) { return v; }
template <> __device__ __forceinline__ half_t store_as<half_t>(float v) { return f2h(v); }

template <typename T>
__device__ __forceinline__ void qkv_rope_body(const float* __restrict__ qkv, const float* __restrict__ bias,
                                              const float* __restrict__ cs, const float* __restrict__ sn,
                                              T* __restrict__ q, T* __restrict__ k, T* __restrict__ v, int n, int H,
                                              int D) {
    // a block per token (rows past gridDim.x in a loop), its threads over the H D columns: no 64-bit divisions
    const int half = D / 2, HD = H * D;
    for (long long t = blockIdx.x; t < n; t += gridDim.x) {
        const float* row = qkv + t * 3 * HD;
        for (int e = threadIdx.x; e < HD; e += blockDim.x) {
            const int i = e % D, h0 = e - i;
            const int j = i < half ? i : i - half, p = i < half ? i + half : i - half;   // i's partner column
            const float c = cs[t * half + j], s = sn[t * half + j];
            float out[2];
            for (int m = 0; m < 2; ++m) {                   // q, then k
                const int b = m * HD + h0;
                const float xi = row[b + i] + bias[b + i], xp = row[b + p] + bias[b + p];
                out[m] = i < half ? xi * c - xp * s : xi * c + xp * s;
            }
            const long long o = t * HD + e;
            q[o] = store_as<T>(out[0]);
            k[o] = store_as<T>(out[1]);
            v[o] = store_as<T>(row[2 * HD + e] + bias[2 * HD + e]);
        }
    }
}
extern "C" __global__ void qkv_rope_half(const float* qkv, const float* bias, const float* cs, const float* sn,
                                         half_t* q, half_t* k, half_t* v, int n, int H, int D) {
    qkv_rope_body<half_t>(qkv, bias, cs, sn, q, k, v, n, H, D);
}
extern "C" __global__ void qkv_rope_f32(const float* qkv, const float* bias, const float* cs, const float* sn,
                                        float* q, float* k, float* v, int n, int H, int D) {
    qkv_rope_body<float>(qkv, bias, cs, sn, q, k, v, n, H, D);
}

// bias_gelu_tanh: y = gelu_tanh(x + b[col]) over x [R, N] fp32 (b may be null), into y16 (fp16: the next GEMM's
// operand, fast path) or y32 (fp32), whichever is non-null. In fp32 and in numpy's order of operations
// (cpu.py::gelu_tanh); the _rn intrinsics keep NVRTC from contracting products and sums into FMAs, so only
// tanhf's last bits differ from numpy.
__device__ __forceinline__ float gelu_tanh_f(float x) {
    const float cube = __fmul_rn(__fmul_rn(__fmul_rn(0.044715f, x), x), x);
    const float th = tanhf(__fmul_rn(0.7978845608028654f, __fadd_rn(x, cube)));
    return __fmul_rn(__fmul_rn(0.5f, x), __fadd_rn(1.0f, th));
}
extern "C" __global__ void bias_gelu_tanh(const float* __restrict__ x, const float* __restrict__ b,
                                          half_t* __restrict__ y16, float* __restrict__ y32, long long R, int N) {
    // a block per row (rows past gridDim.x in a loop), its threads over the N columns: no 64-bit divisions
    for (long long r = blockIdx.x; r < R; r += gridDim.x) {
        for (int c = threadIdx.x; c < N; c += blockDim.x) {
            const long long e = r * N + c;
            const float y = gelu_tanh_f(b ? __fadd_rn(x[e], b[c]) : x[e]);
            if (y16) y16[e] = f2h(y);
            else y32[e] = y;
        }
    }
}
