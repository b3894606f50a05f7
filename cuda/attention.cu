// Causal GQA attention inside packed sequences, flash-style: online softmax, never an L x L matrix.
//
// numpy twin: clefcore/backends/cpu.py::attention (q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]).
//
// sm_70 design (docs/sm70-design.md): a block owns 64 query rows of one query head (4 warps x 16 rows) and
// walks the key/value tiles of its sequence up to its last query (causal), BC = 64 keys per tile (32 when
// D = 256, to stay under Volta's 96 KB of shared memory: Q 33 KB + K 17 KB + V 17 KB + S/P 15 KB).
// Q K^T and P V run on the tensor cores (fp16 operands, fp32 accumulate); scores, the running max m, the
// running sum l and the rescaling stay fp32. The O accumulator lives in wmma fragments (D/16 of them per
// warp); their opaque element -> row map is read once from a fragment loaded from a matrix of row numbers,
// which is how each element finds its row's rescale factor alpha = exp(m_old - m_new).
// Inputs are fp16 (q converted per call; k/v usually an fp16 K/V cache of the whole stream), tiles =
// (seq_start, seq_end, q0, q1) in absolute token indices of the packed stream. Token-blocked prefill: q and out
// hold only the rows [qbase, qbase + n) (one block of queries), k/v the rows [0, >= q1); seq_end is clipped by
// the host to the block's end, so rows of the cache not yet written for this layer are never read.
#include "mma_sm70.cuh"

// Keys per tile at head dim 256: 32 fits Volta's 96 KB per block (two blocks per SM on newer GPUs).
#ifndef ATTN_BC256
#define ATTN_BC256 32
#endif

template <int D, int BC>
struct AttnSmem {
    static constexpr int LDQ = D + 8;           // halves
    static constexpr int LDS = BC + 4;          // floats
    static constexpr int LDP = BC + 8;          // halves
    static constexpr int Q = 64 * LDQ * 2;
    static constexpr int K = BC * LDQ * 2;
    static constexpr int S = 4 * 16 * LDS * 4;
    static constexpr int P = 4 * 16 * LDP * 2;
    static constexpr int IDX = 256 * 4;
    static constexpr int ST = 4 * 16 * 4;
    static constexpr int total = Q + 2 * K + S + P + IDX + ST;
};

template <int D, int BC>
__device__ __forceinline__ void attn_body(const half_t* __restrict__ q, const half_t* __restrict__ k,
                                          const half_t* __restrict__ v, float* __restrict__ out,
                                          const int4* __restrict__ tiles, int Hq, int Hkv, float scale,
                                          int qbase) {
    typedef AttnSmem<D, BC> L;
    extern __shared__ __align__(128) unsigned char smem[];
    half_t* sQ = (half_t*)smem;
    half_t* sK = (half_t*)(smem + L::Q);
    half_t* sV = (half_t*)(smem + L::Q + L::K);
    float* sS = (float*)(smem + L::Q + 2 * L::K);
    half_t* sP = (half_t*)(smem + L::Q + 2 * L::K + L::S);
    float* sIdx = (float*)(smem + L::Q + 2 * L::K + L::S + L::P);
    float* sAl = (float*)(smem + L::Q + 2 * L::K + L::S + L::P + L::IDX);

    const int4 tile = tiles[blockIdx.x];
    const int s0 = tile.x, s1 = tile.y, q0 = tile.z, q1 = tile.w;
    const int h = blockIdx.y, kh = h / (Hq / Hkv);
    const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
    constexpr int V8 = D / 8;   // uint4 (8 halves) per row

    for (int e = t; e < 64 * V8; e += 128) {
        const int r = e / V8, c = (e % V8) * 8, qi = q0 + r;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (qi < q1) val = *(const uint4*)(q + ((long long)(qi - qbase) * Hq + h) * D + c);
        *(uint4*)(sQ + r * L::LDQ + c) = val;
    }
    for (int e = t; e < 256; e += 128) sIdx[e] = (float)(e >> 4);
    __syncthreads();
    FragC idx;
    load_c_row(idx, sIdx, 16);

    FragC o[D / 16];
#pragma unroll
    for (int f = 0; f < D / 16; ++f) frag_zero(o[f]);
    float m = -CLEF_INF, l = 0.f;                     // of row (lane >> 1), shared by the lane pair
    const int myrow = lane >> 1, colh = (lane & 1) * (BC / 2);
    const int qi = q0 + warp * 16 + myrow;
    const bool warp_live = q0 + warp * 16 < q1;
    float* sSw = sS + warp * 16 * L::LDS;
    half_t* sPw = sP + warp * 16 * L::LDP;
    float* sAlw = sAl + warp * 16;
    const unsigned aQ = sa(sQ + warp * 16 * L::LDQ), aK = sa(sK), aV = sa(sV), aS = sa(sSw), aP = sa(sPw);

    for (int j0 = s0; j0 < q1; j0 += BC) {
        __syncthreads();
        for (int e = t; e < BC * V8; e += 128) {
            const int r = e / V8, c = (e % V8) * 8, kj = j0 + r;
            uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
            if (kj < s1) {
                kv = *(const uint4*)(k + ((long long)kj * Hkv + kh) * D + c);
                vv = *(const uint4*)(v + ((long long)kj * Hkv + kh) * D + c);
            }
            *(uint4*)(sK + r * L::LDQ + c) = kv;
            *(uint4*)(sV + r * L::LDQ + c) = vv;
        }
        __syncthreads();
        if (!warp_live || j0 > q0 + warp * 16 + 15) continue;   // nothing visible for this warp's rows
        {
            // S = Q K^T for this warp's 16 rows: each Q fragment is read once per tile, for every key column tile
            FragC s[BC / 16];
#pragma unroll
            for (int n = 0; n < BC / 16; ++n) frag_zero(s[n]);
#pragma unroll 4
            for (int kd = 0; kd < D / 16; ++kd) {
                FragA a;
                lda_row(a, aQ + 2 * kd * 16, L::LDQ);
#pragma unroll
                for (int n = 0; n < BC / 16; ++n) {
                    FragB b;
                    ldb_col(b, aK + 2 * (n * 16 * L::LDQ + kd * 16), L::LDQ);
                    mma_row_col(s[n], a, b);
                }
            }
#pragma unroll
            for (int n = 0; n < BC / 16; ++n) stc_row(aS + 4 * n * 16, s[n], L::LDS);
        }
        __syncwarp();
        // online softmax on this lane's half row
        float mx = -CLEF_INF;
        for (int c = 0; c < BC / 2; ++c) {
            const int kj = j0 + colh + c;
            float sv = sSw[myrow * L::LDS + colh + c] * scale;
            if (kj > qi || kj >= s1) sv = -CLEF_INF;
            sSw[myrow * L::LDS + colh + c] = sv;
            mx = fmaxf(mx, sv);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        const float mnew = fmaxf(m, mx);
        const float muse = mnew == -CLEF_INF ? 0.f : mnew;
        const float alpha = m == -CLEF_INF ? 0.f : expf(m - muse);
        float ps = 0.f;
        for (int c = 0; c < BC / 2; ++c) {
            const float sv = sSw[myrow * L::LDS + colh + c];
            const float p = sv == -CLEF_INF ? 0.f : expf(sv - muse);
            const half_t ph = f2h(p);
            ps += p;
            sPw[myrow * L::LDP + colh + c] = ph;
        }
        ps += __shfl_xor_sync(0xffffffffu, ps, 1);
        l = l * alpha + ps;
        m = mnew;
        // once a row's maximum settles, alpha is exactly 1: most tiles skip the rescale of the accumulators
        const bool rescale = __any_sync(0xffffffffu, alpha != 1.f);
        if ((lane & 1) == 0) sAlw[myrow] = alpha;
        __syncwarp();
        if (rescale) {
            float al[8];                              // the rows of this lane's 8 accumulator elements
#pragma unroll
            for (int e = 0; e < 8; ++e) al[e] = sAlw[(int)idx.x[e]];
#pragma unroll
            for (int f = 0; f < D / 16; ++f)
#pragma unroll
                for (int e = 0; e < 8; ++e) o[f].x[e] *= al[e];
        }
        FragA pa[BC / 16];
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) lda_row(pa[kk], aP + 2 * kk * 16, L::LDP);
#pragma unroll
        for (int f = 0; f < D / 16; ++f) {
#pragma unroll
            for (int kk = 0; kk < BC / 16; ++kk) {
                FragB b;
                ldb_row(b, aV + 2 * (kk * 16 * L::LDQ + f * 16), L::LDQ);
                mma_row_row(o[f], pa[kk], b);
            }
        }
        __syncwarp();
    }
    if (!warp_live) return;
    if ((lane & 1) == 0) sAlw[myrow] = l > 0.f ? 1.f / l : 0.f;
    __syncwarp();
    float inv[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) inv[e] = sAlw[(int)idx.x[e]];
#pragma unroll
    for (int f = 0; f < D / 16; ++f) {
#pragma unroll
        for (int e = 0; e < 8; ++e) o[f].x[e] *= inv[e];
        stc_row(aS, o[f], L::LDS);
        __syncwarp();
        const int r = lane >> 1, c0 = (lane & 1) * 8, row = q0 + warp * 16 + r;
        if (row < q1) {
            float* dst = out + ((long long)(row - qbase) * Hq + h) * D + f * 16 + c0;
            const float* src = sSw + r * L::LDS + c0;
            *(float4*)dst = *(const float4*)src;
            *(float4*)(dst + 4) = *(const float4*)(src + 4);
        }
        __syncwarp();
    }
}

#define CLEF_ATTN(D, BC)                                                                                   \
    extern "C" __global__ void __launch_bounds__(128) attn_fwd_d##D(const half_t* q, const half_t* k,        \
                                                                   const half_t* v, float* out,              \
                                                                   const int4* tiles, int Hq, int Hkv,       \
                                                                   float scale, int qbase) {                 \
        attn_body<D, BC>(q, k, v, out, tiles, Hq, Hkv, scale, qbase);                                      \
    }                                                                                                      \
    extern "C" __global__ void attn_smem_d##D(int* n) { *n = AttnSmem<D, BC>::total; }
CLEF_ATTN(16, 64)
CLEF_ATTN(32, 64)
CLEF_ATTN(64, 64)
CLEF_ATTN(128, 64)
CLEF_ATTN(256, ATTN_BC256)
#undef CLEF_ATTN
