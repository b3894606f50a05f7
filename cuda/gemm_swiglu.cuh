// The MLP's gate and up projections and SwiGLU as one GEMM on the "mma" route (the fused_elementwise switch):
// H[M, N] (fp16) = fp16(silu(A Wg^T) * (A Wu^T)), A [M, K] fp16, Wg and Wu [N, K] fp16. What gemm_mma.cu and
// gemm_wgmma.cu share of it: which weight row each column of the tile reads, and the epilogue.
//
// numpy twin: clefcore/backends/cpu.py::mlp (its hidden product, before the down projection).
//
// The kernels run their ordinary GEMM over a "paired" weight that is never stored: its rows come in groups of
// 16, rows 8 q .. 8 q + 7 of Wg, then the same rows of Wu (swiglu_row). Both routes hold their accumulators in
// m16n8 tiles (mma.sync's, and wgmma's, which repeats that layout along n): columns 8 j + 2 (lane % 4) (+ 1) of
// rows lane / 4 (+ 8). With the tiles' column origins multiples of 16, tile 2 j holds gate sums and tile 2 j + 1
// the up sums of the very same outputs, in the same registers of the same thread, so the epilogue
// (gemm_tile.cuh's gemm_store_row, through swiglu_put2) pairs them with no exchange. Each sum is the plain
// kernel's on the same A row and weight row, k step by k step in the same order (zero-filled past K alike), so it
// is bit for bit that kernel's output; the SwiGLU is gemm.cu's swiglu_half (silu_f, one product, one cvt.rn): the
// fused result is the bits of two plain GEMMs and swiglu_half.
#pragma once
#include "mma_sm70.cuh"

// The paired weight's row p: row 8 (p / 16) + p % 8 of Wg (p % 16 < 8) or of Wu. ok = false where that row is
// past N (the last group's padding, and every p from 16 ceil(N / 8) on: the grid's last tile): the pointer is
// then row 0's and the copy zero-fills instead of reading it. The launch covers 16 ceil(N / 8) paired rows
// (matmul.py's swiglu_paired_rows).
__device__ __forceinline__ const half_t* swiglu_row(const half_t* __restrict__ Wg, const half_t* __restrict__ Wu,
                                                    int p, int N, int K, bool& ok) {
    const int row = ((p >> 4) << 3) | (p & 7);
    ok = row < N;
    return ((p & 8) ? Wu : Wg) + (size_t)(ok ? row : 0) * K;
}

// Outputs (gr, oc) and (gr, oc + 1) from their gate sums g0, g1 and up sums u0, u1 (oc even: the m16n8 layout's
// column pair, mapped back from paired columns: oc = 8 q + 2 (lane % 4) for group q); columns past N are not
// written. Two halves go out as one 4-byte store where N is even (the address is then even in halves).
__device__ __forceinline__ void swiglu_put2(half_t* __restrict__ H, int N, int gr, int oc, float g0, float g1,
                                            float u0, float u1) {
    const size_t o = (size_t)gr * N + oc;
    const half_t h0 = f2h(silu_f(g0) * u0), h1 = f2h(silu_f(g1) * u1);
    if ((N & 1) == 0 && oc + 1 < N) {
        *(unsigned*)(H + o) = (unsigned)h0 | ((unsigned)h1 << 16);
    } else {
        if (oc < N) H[o] = h0;
        if (oc + 1 < N) H[o + 1] = h1;
    }
}
