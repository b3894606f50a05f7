// What the tensor-core GEMMs gemm_mma.cu (mma.sync) and gemm_wgmma.cu (wgmma) share apart from their main loops:
// their entry points (one argument list each for the plain and the fused kernels, which the host launches alike),
// the order blocks take their output tiles in, and the epilogue that writes a row of accumulators.
//
// numpy twin: clefcore/backends/cpu.py::linear (plain, + bias, + residual) and, fused, cpu.py::mlp's hidden
// product (gemm_swiglu.cuh).
//
// Both kernels hold their accumulators in m16n8 tiles (mma.sync's layout, which wgmma repeats along n): a thread
// holds columns 8 j + 2 (lane % 4) and + 1 of rows lane / 4 and + 8 of each tile.
#pragma once
#include "gemm_swiglu.cuh"

// Blocks are launched in order of blockIdx.x fastest; handing them out down groups of 8 block rows (then across)
// makes 8 consecutive blocks share one W tile column while it is in L2: at N = 12,288, K = 4096 the weight
// (100 MB) no longer streams from memory once per block row. -> this block's tile row bm and column bn.
__device__ __forceinline__ void gemm_block_order(int& bm, int& bn) {
    const int grid_m = gridDim.y, pid = blockIdx.y * gridDim.x + blockIdx.x, width = 8 * gridDim.x;
    const int first = (pid / width) * 8, rows = min(grid_m - first, 8);
    bm = first + (pid % width) % rows;
    bn = (pid % width) / rows;
}

// One accumulator row after the k loop: row gr (< M) of NJ n8 tiles, tile j's values acc(j, 0) and acc(j, 1) at
// columns col0 + 8 j + 2 (lane % 4) and + 1.
//   plain: C[gr, c] (fp32) = acc (+ bias[c]) (+ res[gr, c]); columns past N are not written; two columns go out as
//     one float2 where pair (N even, which keeps them 8-byte aligned; the caller's, once for all rows). H unused.
//   SWIGLU: the columns are paired ones (col0 a multiple of 16, gemm_swiglu.cuh): tile 2 jj holds the gate sums,
//     tile 2 jj + 1 the up sums of outputs col0 / 2 + 8 jj + 2 (lane % 4) and + 1 of H (swiglu_put2). bias, res
//     and C unused.
template <int NJ, bool SWIGLU, class Acc>
__device__ __forceinline__ void gemm_store_row(const float* __restrict__ bias, const float* __restrict__ res,
                                               float* __restrict__ C, half_t* __restrict__ H, int N, bool pair,
                                               int gr, int col0, int lane, Acc acc) {
    if (SWIGLU) {
#pragma unroll
        for (int jj = 0; jj < NJ / 2; ++jj) {
            const int oc = col0 / 2 + jj * 8 + (lane & 3) * 2;
            swiglu_put2(H, N, gr, oc, acc(2 * jj, 0), acc(2 * jj, 1), acc(2 * jj + 1, 0), acc(2 * jj + 1, 1));
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
        const int gc = col0 + j * 8 + (lane & 3) * 2;
        float v0 = acc(j, 0), v1 = acc(j, 1);
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

// The entry points, as matmul.py launches them: NAME(A, W, bias, res, C, M, N, K), C [M, N] fp32 = A W^T (+ bias)
// (+ res), and the fused MLP NAME(A, Wg, Wu, H, M, N, K), H [M, N] fp16 = silu(A Wg^T) * (A Wu^T). GEMM is the
// file's tile template, instantiated as GEMM<tile..., SWIGLU> with the tile's parameters after it; BOUNDS its
// __launch_bounds__. GEMM's body is empty on the architectures its file does not build for.
#define GEMM_F32_ENTRY(NAME, BOUNDS, GEMM, ...)                                                                     \
    extern "C" __global__ void BOUNDS NAME(const half_t* __restrict__ A, const half_t* __restrict__ W,              \
                                           const float* __restrict__ bias, const float* __restrict__ res,           \
                                           float* __restrict__ C, int M, int N, int K) {                            \
        GEMM<__VA_ARGS__, false>(A, W, nullptr, bias, res, C, nullptr, M, N, K);                                    \
    }
#define GEMM_SWIGLU_ENTRY(NAME, BOUNDS, GEMM, ...)                                                                  \
    extern "C" __global__ void BOUNDS NAME(const half_t* __restrict__ A, const half_t* __restrict__ Wg,             \
                                           const half_t* __restrict__ Wu, half_t* __restrict__ H, int M, int N,     \
                                           int K) {                                                                 \
        GEMM<__VA_ARGS__, true>(A, Wg, Wu, nullptr, nullptr, nullptr, H, M, N, K);                                  \
    }
