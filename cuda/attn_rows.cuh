// The per-row steps of the flash attention kernels whose scores and output accumulate in mma.sync's m16n8 layout,
// shared by attention.cu's sm_80 body and attention_wgmma.cu (whose wgmma accumulators repeat that layout): a
// thread holds two rows, r and r + 8 (index 0 and 1 below), and a quad of lanes (the same lane / 4) the columns of
// one row, 2 (lane % 4) and + 1 of each n8 tile.
//
// No numpy twin of its own: these are steps of the kernels whose twin is clefcore/backends/cpu.py::attention.
#pragma once
#include "mma_sm70.cuh"

// A key tile's new running maxima: mx holds this thread's max of m and of its scaled, masked scores in the tile
// (the quad's max is taken here). m <- the new max; muse = the max the probabilities subtract (0 while a row has
// seen only masked keys, so that exp2(-inf - 0) = 0); alpha = exp2(m_old - muse), the factor that rescales O and
// the running sum l to the new max (0 while m_old is -inf); l is rescaled here.
__device__ __forceinline__ void attn_new_max(float (&mx)[2], float (&m)[2], float (&l)[2], float (&muse)[2],
                                             float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
        muse[i] = mx[i] == -CLEF_INF ? 0.f : mx[i];
        alpha[i] = exp2f(m[i] - muse[i]);   // 0 while m is -inf
        m[i] = mx[i];
        l[i] *= alpha[i];
    }
}

// The end of a block: l (this lane's part of the running sums) <- 1 / the quad's sum (0 for a row that saw no key),
// then rows r and r + 8 of head h's D output columns, those below q1, = O * l, two columns a float2 store. o holds
// 4 accumulators per n8 tile: o[4 i + e] is column 8 i + 2 tq + (e & 1) of row r + 8 (e >> 1) (tq = lane % 4).
// out holds the rows [qbase, ...) of [T, Hq, D].
template <int D>
__device__ __forceinline__ void attn_write_rows(float* __restrict__ out, float (&l)[2], const float* o, int r,
                                                int q1, int qbase, int Hq, int h, int tq) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
        l[i] = l[i] > 0.f ? 1.f / l[i] : 0.f;
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
        const int row = r + hr * 8;
        if (row >= q1) continue;
        float* dst = out + ((long long)(row - qbase) * Hq + h) * D + 2 * tq;
#pragma unroll
        for (int i = 0; i < D / 8; ++i)
            *(float2*)(dst + i * 8) = make_float2(o[4 * i + 2 * hr] * l[hr], o[4 * i + 2 * hr + 1] * l[hr]);
    }
}
