// GQA attention inside packed sequences, flash-style: online softmax, never an L x L matrix. Causal for the text
// backbone (attn_fwd_d{D}), bidirectional for the vision tower (attn_bidir_d{D}: every query of a sequence, one
// image's patches, sees all of that sequence's keys). One body, CAUSAL a template flag.
//
// numpy twins: clefcore/backends/cpu.py::attention (q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]) and
// clefcore/backends/cpu.py::bidirectional_attention.
//
// Two bodies behind one entry point: sm_80+ compiles the mma.sync path below (known fragment layouts), every
// other target (sm_70 first) the wmma path. Shared by both: a block owns 16 NW query rows of one query head (NW
// warps x 16 rows) and walks the key/value tiles of its sequence up to its last query (causal) or to its end
// (bidirectional), BC keys per tile. NW = 4, BC = 64, except at D = 256 (ATTN_NW256 / ATTN_BC256 below; on sm_70
// 4 x 32, to stay under Volta's 96 KB of shared memory: Q 33 KB + K 17 KB + V 17 KB + S/P 15 KB) and the
// vision tower's D = 72 on sm_80+ (ATTN_NW72: 8 warps).
// Q K^T and P V run on the tensor cores (fp16 operands, fp32 accumulate); scores, the running max m, the
// running sum l and the rescaling stay fp32; P is rounded to fp16 for P V. Scores are scaled by scale * log2(e)
// (scale2) so that each probability is one exp2; only tiles that reach past a warp's first row (causal) or past
// the sequence's end are masked. Blocks run heads fastest over tiles sorted longest first (the host's order), so
// every head's longest key ranges start in the first wave rather than the last head's at the end.
// wmma path: the O accumulator lives in wmma fragments (DP/16 of them per warp); their opaque element -> row
// map is read once from a fragment loaded from a matrix of row numbers, which is how each element finds its
// row's rescale factor alpha = exp2(m_old - m_new). Scores go through shared memory for the softmax.
// mma.sync path (sm_80+): m16n8k16 with the PTX-documented layouts, so the softmax runs in registers (a quad of
// lanes shares a row), P is repacked from the score accumulators straight into A fragments (no shared-memory
// round trip), fragments come from ldmatrix, and the K/V tiles are double-buffered with cp.async.
// Inputs are fp16 (q converted per call; k/v usually an fp16 K/V cache of the whole stream), tiles =
// (seq_start, seq_end, q0, q1) in absolute token indices of the packed stream. Token-blocked prefill: q and out
// hold only the rows [qbase, qbase + n) (one block of queries), k/v the rows [0, >= q1); seq_end is clipped by
// the host to the block's end, so rows of the cache not yet written for this layer are never read.
// Head dims that are not a multiple of 16 (72, the vision tower's: 1152 / 16 heads) run at DP, D rounded up to 16
// (the tensor cores step 16 wide in k and in the n of P V), in shared memory only: global rows stay D wide, the
// pad columns D..DP of the Q, K and V tiles are zeroed once per block and never loaded over, so they add nothing
// to q.k and come out of P V as zeros that are not written. Padding q/k/v on the host instead would cost a padded
// copy of each and an unpadding copy of the output; natively at 72, a k8 step and odd n8 tiles in both bodies.
#include "mma_sm70.cuh"
#include "attn_rows.cuh"

// Head dim 256: warps per block (NW, 16 query rows each) and keys per tile (BC). sm_90 (227 KB of shared memory
// per block): 128 query rows share each 64-key tile, 198 KB, one block per SM; measured on the H200 at 8192 /
// 24,576 tokens 165 / 190 TFLOP/s against 156 / 177 for 4 warps x 32 keys (which 8 x 32 and 4 x 64 did not
// beat: every variant holds 239 registers per thread, the O accumulator alone 128); 257 / 265 since the exp2
// softmax and the heads-first grid (H200, 4bb0b08). Elsewhere 4 x 32: 81 KB in
// the wmma body (under sm_70's 96 KB), 99 KB in the mma.sync body (sm_86/89's limit; two blocks per SM on sm_80).
#if __CUDA_ARCH__ >= 900
#define ATTN_NW256 8
#define ATTN_BC256 64
#else
#define ATTN_NW256 4
#define ATTN_BC256 32
#endif

// the block's 16 NW query rows of head h (zeros from q1 on and in the pad columns D..DP) -> shared memory, rows
// ld halves apart (both bodies)
template <int D, int DP, int NW>
__device__ __forceinline__ void stage_q(half_t* sQ, int ld, const half_t* __restrict__ q, int q0, int q1,
                                        int qbase, int Hq, int h) {
    constexpr int V8 = DP / 8;   // 16-byte pieces per row
    for (int e = threadIdx.x; e < 16 * NW * V8; e += 32 * NW) {
        const int r = e / V8, c = (e % V8) * 8, qi = q0 + r;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (qi < q1 && (DP == D || c < D)) val = *(const uint4*)(q + ((long long)(qi - qbase) * Hq + h) * D + c);
        *(uint4*)(sQ + r * ld + c) = val;
    }
}

// zeros in the pad columns D..DP of n rows of K/V tiles (ld halves apart): the tile loads write columns 0..D
// only, so once per block is enough; nothing at all when D is a multiple of 16
template <int D, int DP, int NW>
__device__ __forceinline__ void zero_pad(half_t* s, int ld, int n) {
    if constexpr (DP > D) {
        constexpr int P8 = (DP - D) / 8;
        for (int e = threadIdx.x; e < n * P8; e += 32 * NW)
            *(uint4*)(s + (e / P8) * ld + D + (e % P8) * 8) = make_uint4(0, 0, 0, 0);
    }
}

// D padded to the tensor cores' 16 (shared-memory tiles and accumulators); rows move in 16-byte pieces
template <int D>
struct AttnDim {
    static_assert(D % 8 == 0, "head dim must be a multiple of 8");
    static constexpr int P = (D + 15) / 16 * 16;
};

#if __CUDA_ARCH__ >= 800
__device__ __forceinline__ void ldsm4(unsigned (&r)[4], unsigned a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldsm4_t(unsigned (&r)[4], unsigned a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
// d[16x8] += a[16x16] b[16x8]; lane (g = lane/4, t = lane%4) holds d rows g, g+8 at columns 2t, 2t+1
__device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int bytes) {   // bytes 0: zero fill
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(bytes));
}

template <int D, int BC, int NW>
struct AttnSmem {
    static constexpr int LD = AttnDim<D>::P + 8;   // halves: 16-byte rows, conflict-free ldmatrix
    static constexpr int Q = 16 * NW * LD * 2;
    static constexpr int KV = BC * LD * 2;      // one K (or V) tile
    static constexpr int total = Q + 4 * KV;    // K and V, two buffers each
};

template <int D, int BC, int NW, bool CAUSAL>
__device__ __forceinline__ void attn_body(const half_t* __restrict__ q, const half_t* __restrict__ k,
                                          const half_t* __restrict__ v, float* __restrict__ out,
                                          const int4* __restrict__ tiles, int Hq, int Hkv, float scale2,
                                          int qbase) {
    typedef AttnSmem<D, BC, NW> L;
    constexpr int DP = AttnDim<D>::P;
    extern __shared__ __align__(128) unsigned char smem[];
    half_t* sQ = (half_t*)smem;
    const unsigned aQ = sa(smem), aKV = aQ + L::Q;   // buffer b: K at aKV + 2 b KV, V right after it
    const int4 tile = tiles[blockIdx.y];
    const int s0 = tile.x, s1 = tile.y, q0 = tile.z, q1 = tile.w;
    const int h = blockIdx.x, kh = h / (Hq / Hkv);
    const int t = threadIdx.x, warp = t >> 5, lane = t & 31, g = lane >> 2, tq = lane & 3;
    constexpr int V8 = D / 8;   // 16-byte pieces per row (pad columns excluded)
    const int jend = CAUSAL ? q1 : s1;   // past the block's last query, or the sequence's end

    stage_q<D, DP, NW>(sQ, L::LD, q, q0, q1, qbase, Hq, h);
    zero_pad<D, DP, NW>((half_t*)(smem + L::Q), L::LD, 4 * BC);   // both buffers of K and V
    auto load_kv = [&](int j0, int buf) {     // rows past the sequence are zero-filled (finite for P V)
        const unsigned dK = aKV + 2 * buf * L::KV;
        for (int e = t; e < BC * V8; e += 32 * NW) {
            const int r = e / V8, c = (e % V8) * 8, kj = j0 + r;
            const bool in = kj < s1;
            const long long off = ((long long)(in ? kj : s0) * Hkv + kh) * D + c;
            const unsigned so = 2 * (r * L::LD + c);
            cp_async16(dK + so, k + off, in ? 16 : 0);
            cp_async16(dK + L::KV + so, v + off, in ? 16 : 0);
        }
        asm volatile("cp.async.commit_group;");
    };

    float o[DP / 8][4];
#pragma unroll
    for (int i = 0; i < DP / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m[2] = {-CLEF_INF, -CLEF_INF}, l[2] = {0.f, 0.f};   // rows r0 and r0 + 8 (l: this lane's columns)
    const int r0 = q0 + warp * 16 + g;
    const bool warp_live = q0 + warp * 16 < q1;
    load_kv(s0, 0);
    int buf = 0;
    for (int j0 = s0; j0 < jend; j0 += BC, buf ^= 1) {
        if (j0 + BC < jend) {
            load_kv(j0 + BC, buf ^ 1);         // the buffer the previous tile used: freed by its last barrier
            asm volatile("cp.async.wait_group 1;");
        } else {
            asm volatile("cp.async.wait_group 0;");
        }
        __syncthreads();
        // causal: else nothing in this tile is visible to the warp
        if (warp_live && (!CAUSAL || j0 <= q0 + warp * 16 + 15)) {
            const unsigned aK = aKV + 2 * buf * L::KV, aV = aK + L::KV;
            float s[BC / 8][4];
#pragma unroll
            for (int i = 0; i < BC / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll 4
            for (int kd = 0; kd < DP / 16; ++kd) {
                unsigned a[4];
                ldsm4(a, aQ + 2 * ((warp * 16 + (lane & 15)) * L::LD + kd * 16 + (lane >> 4) * 8));
#pragma unroll
                for (int nb = 0; nb < BC / 16; ++nb) {       // keys 16 nb .. 16 nb + 15: two n8 tiles
                    unsigned b[4];
                    ldsm4(b, aK + 2 * ((nb * 16 + (lane & 7) + (lane >> 4) * 8) * L::LD + kd * 16 +
                                       ((lane >> 3) & 1) * 8));
                    mma16816(s[2 * nb], a, b[0], b[1]);
                    mma16816(s[2 * nb + 1], a, b[2], b[3]);
                }
            }
            float mx[2] = {m[0], m[1]};
            // keys past the warp's first row (or past s1); bidirectional: only keys past s1, in the last tile
            const bool diag = CAUSAL ? j0 + BC - 1 > q0 + warp * 16 : j0 + BC > s1;
#pragma unroll
            for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int kj = j0 + nt * 8 + 2 * tq + (e & 1);
                    float sv = s[nt][e] * scale2;
                    if (diag && ((CAUSAL && kj > r0 + (e >> 1) * 8) || kj >= s1)) sv = -CLEF_INF;
                    s[nt][e] = sv;
                    mx[e >> 1] = fmaxf(mx[e >> 1], sv);
                }
            float muse[2], alpha[2];
            attn_new_max(mx, m, l, muse, alpha);
            unsigned pa[BC / 16][4];   // P as A fragments: the score tile pair (2 kk, 2 kk + 1) is rows g / g+8
#pragma unroll
            for (int nt = 0; nt < BC / 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float p = exp2f(s[nt][e] - muse[e >> 1]);   // masked: exp2(-inf) = 0
                    l[e >> 1] += p;
                    s[nt][e] = p;
                }
                pa[nt >> 1][(nt & 1) * 2] = pack2h(s[nt][0], s[nt][1]);
                pa[nt >> 1][(nt & 1) * 2 + 1] = pack2h(s[nt][2], s[nt][3]);
            }
            if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {   // a row maximum moved
#pragma unroll
                for (int i = 0; i < DP / 8; ++i) {
                    o[i][0] *= alpha[0]; o[i][1] *= alpha[0]; o[i][2] *= alpha[1]; o[i][3] *= alpha[1];
                }
            }
#pragma unroll
            for (int kk = 0; kk < BC / 16; ++kk) {
#pragma unroll
                for (int dp = 0; dp < DP / 16; ++dp) {      // columns 16 dp .. 16 dp + 15: two n8 tiles
                    unsigned b[4];
                    ldsm4_t(b, aV + 2 * ((kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * L::LD + dp * 16 +
                                         (lane >> 4) * 8));
                    mma16816(o[2 * dp], pa[kk], b[0], b[1]);
                    mma16816(o[2 * dp + 1], pa[kk], b[2], b[3]);
                }
            }
        }
        __syncthreads();   // this buffer is free for the tile after next
    }
    if (!warp_live) return;
    // the D real columns (the pad's accumulators hold zeros); o's tiles lie one after the other, 4 floats each
    attn_write_rows<D>(out, l, &o[0][0], r0, q1, qbase, Hq, h, tq);
}
#else
template <int D, int BC, int NW>
struct AttnSmem {
    static constexpr int LDQ = AttnDim<D>::P + 8;   // halves
    static constexpr int LDS = BC + 4;          // floats
    static constexpr int LDP = BC + 8;          // halves
    static constexpr int Q = 16 * NW * LDQ * 2;
    static constexpr int K = BC * LDQ * 2;
    static constexpr int S = NW * 16 * LDS * 4;
    static constexpr int P = NW * 16 * LDP * 2;
    static constexpr int IDX = 256 * 4;
    static constexpr int ST = NW * 16 * 4;
    static constexpr int total = Q + 2 * K + S + P + IDX + ST;
};

template <int D, int BC, int NW, bool CAUSAL>
__device__ __forceinline__ void attn_body(const half_t* __restrict__ q, const half_t* __restrict__ k,
                                          const half_t* __restrict__ v, float* __restrict__ out,
                                          const int4* __restrict__ tiles, int Hq, int Hkv, float scale2,
                                          int qbase) {
    typedef AttnSmem<D, BC, NW> L;
    constexpr int DP = AttnDim<D>::P;
    extern __shared__ __align__(128) unsigned char smem[];
    half_t* sQ = (half_t*)smem;
    half_t* sK = (half_t*)(smem + L::Q);
    half_t* sV = (half_t*)(smem + L::Q + L::K);
    float* sS = (float*)(smem + L::Q + 2 * L::K);
    half_t* sP = (half_t*)(smem + L::Q + 2 * L::K + L::S);
    float* sIdx = (float*)(smem + L::Q + 2 * L::K + L::S + L::P);
    float* sAl = (float*)(smem + L::Q + 2 * L::K + L::S + L::P + L::IDX);

    const int4 tile = tiles[blockIdx.y];
    const int s0 = tile.x, s1 = tile.y, q0 = tile.z, q1 = tile.w;
    const int h = blockIdx.x, kh = h / (Hq / Hkv);
    const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
    constexpr int V8 = D / 8;   // uint4 (8 halves) per row (pad columns excluded)
    const int jend = CAUSAL ? q1 : s1;   // past the block's last query, or the sequence's end

    stage_q<D, DP, NW>(sQ, L::LDQ, q, q0, q1, qbase, Hq, h);
    zero_pad<D, DP, NW>(sK, L::LDQ, 2 * BC);   // sV follows sK
    for (int e = t; e < 256; e += 32 * NW) sIdx[e] = (float)(e >> 4);
    __syncthreads();
    FragC idx;
    load_c_row(idx, sIdx, 16);

    FragC o[DP / 16];
#pragma unroll
    for (int f = 0; f < DP / 16; ++f) frag_zero(o[f]);
    float m = -CLEF_INF, l = 0.f;                     // of row (lane >> 1), shared by the lane pair
    const int myrow = lane >> 1, colh = (lane & 1) * (BC / 2);
    const int qi = q0 + warp * 16 + myrow;
    const bool warp_live = q0 + warp * 16 < q1;
    float* sSw = sS + warp * 16 * L::LDS;
    half_t* sPw = sP + warp * 16 * L::LDP;
    float* sAlw = sAl + warp * 16;
    const unsigned aQ = sa(sQ + warp * 16 * L::LDQ), aK = sa(sK), aV = sa(sV), aS = sa(sSw), aP = sa(sPw);

    for (int j0 = s0; j0 < jend; j0 += BC) {
        __syncthreads();
        for (int e = t; e < BC * V8; e += 32 * NW) {
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
        // causal: nothing in this tile is visible to the warp's rows
        if (!warp_live || (CAUSAL && j0 > q0 + warp * 16 + 15)) continue;
        {
            // S = Q K^T for this warp's 16 rows: each Q fragment is read once per tile, for every key column tile
            FragC s[BC / 16];
#pragma unroll
            for (int n = 0; n < BC / 16; ++n) frag_zero(s[n]);
#pragma unroll 4
            for (int kd = 0; kd < DP / 16; ++kd) {
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
        // keys past the warp's first row (or past s1); bidirectional: only keys past s1, in the last tile
        const bool diag = CAUSAL ? j0 + BC - 1 > q0 + warp * 16 : j0 + BC > s1;
        for (int c = 0; c < BC / 2; ++c) {
            const int kj = j0 + colh + c;
            float sv = sSw[myrow * L::LDS + colh + c] * scale2;
            if (diag && ((CAUSAL && kj > qi) || kj >= s1)) sv = -CLEF_INF;
            sSw[myrow * L::LDS + colh + c] = sv;
            mx = fmaxf(mx, sv);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        const float mnew = fmaxf(m, mx);
        const float muse = mnew == -CLEF_INF ? 0.f : mnew;
        const float alpha = exp2f(m - muse);                // 0 while m is -inf
        float ps = 0.f;
        for (int c = 0; c < BC / 2; ++c) {
            const float sv = sSw[myrow * L::LDS + colh + c];
            const float p = exp2f(sv - muse);                  // masked: exp2(-inf) = 0
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
            for (int f = 0; f < DP / 16; ++f)
#pragma unroll
                for (int e = 0; e < 8; ++e) o[f].x[e] *= al[e];
        }
        FragA pa[BC / 16];
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) lda_row(pa[kk], aP + 2 * kk * 16, L::LDP);
#pragma unroll
        for (int f = 0; f < DP / 16; ++f) {
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
    for (int f = 0; f < DP / 16; ++f) {
#pragma unroll
        for (int e = 0; e < 8; ++e) o[f].x[e] *= inv[e];
        stc_row(aS, o[f], L::LDS);
        __syncwarp();
        const int r = lane >> 1, c0 = (lane & 1) * 8, row = q0 + warp * 16 + r;
        if (row < q1 && (DP == D || f * 16 + c0 < D)) {   // the D real columns
            float* dst = out + ((long long)(row - qbase) * Hq + h) * D + f * 16 + c0;
            const float* src = sSw + r * L::LDS + c0;
            *(float4*)dst = *(const float4*)src;
            *(float4*)(dst + 4) = *(const float4*)(src + 4);
        }
        __syncwarp();
    }
}

#endif

// attn_launch_d{D}: what the host needs to launch attn_fwd_d{D} / attn_bidir_d{D} as compiled for this device
// (both have one shape): n[0] = dynamic shared memory bytes, n[1] = warps per block (16 query rows per warp).
// The host's lists of these head dims: clefcore/backends/cuda/attention.py (CAUSAL_DIMS, BIDIR_DIMS).
#define CLEF_ATTN_KERNEL(NAME, D, BC, NW, CAUSAL)                                                          \
    extern "C" __global__ void __launch_bounds__(32 * NW) NAME(const half_t* q, const half_t* k,            \
                                                               const half_t* v, float* out,                  \
                                                               const int4* tiles, int Hq, int Hkv,           \
                                                               float scale, int qbase) {                     \
        attn_body<D, BC, NW, CAUSAL>(q, k, v, out, tiles, Hq, Hkv, scale * 1.4426950408889634f, qbase);    \
    }
#define CLEF_ATTN_LAUNCH(D, BC, NW)                                                                        \
    extern "C" __global__ void attn_launch_d##D(int* n) {                                                  \
        n[0] = AttnSmem<D, BC, NW>::total;                                                                 \
        n[1] = NW;                                                                                         \
    }
#define CLEF_ATTN(D, BC, NW)                                                                               \
    CLEF_ATTN_KERNEL(attn_fwd_d##D, D, BC, NW, true)                                                       \
    CLEF_ATTN_KERNEL(attn_bidir_d##D, D, BC, NW, false)                                                    \
    CLEF_ATTN_LAUNCH(D, BC, NW)
CLEF_ATTN(16, 64, 4)
CLEF_ATTN(32, 64, 4)
CLEF_ATTN(64, 64, 4)
CLEF_ATTN(128, 64, 4)
CLEF_ATTN(256, ATTN_BC256, ATTN_NW256)
// the vision tower's head dim (clef-flash: 1152 / 16 heads): bidirectional only. 8 warps (128 query rows) share
// each K/V tile on sm_80+: on the H200 at one 4,096-patch image x 16 heads, 0.317 ms (244 TFLOP/s) against 0.363
// ms for 4 warps; 64 x 128 and 32-key tiles were slower (H200, ad38630). The wmma body keeps 4.
#if __CUDA_ARCH__ >= 800
#define ATTN_NW72 8
#else
#define ATTN_NW72 4
#endif
CLEF_ATTN_KERNEL(attn_bidir_d72, 72, 64, ATTN_NW72, false)
CLEF_ATTN_LAUNCH(72, 64, ATTN_NW72)
#undef CLEF_ATTN
#undef CLEF_ATTN_LAUNCH
#undef CLEF_ATTN_KERNEL
