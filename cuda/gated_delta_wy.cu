// Chunked gated delta rule in the WY (UT-transform) form on fp16 tensor cores, chunk C = 64, fp32 state and solve.
//
// numpy twin: clefcore/backends/cpu.py::gated_delta_rule (state carried in and out); error model:
// tests/gdn_wy_model.py (these kernels' order of operations and operand roundings, in numpy).
//
// Per chunk (numpy names): A = strictly lower (beta_r k_r.k_s exp(G_r - G_s)); (I + A) [U | W] = [beta V |
// beta exp(G) K]. Over the chunks of a sequence in order: V' = U - W S, S <- exp(G_last) S + K^T Vd with
// Vd = V' exp(G_last - G) (the decay folded into V's rows, in fp32, so the keys enter as they are). Per chunk
// again: O = exp(G) (Q S_in) + (Q K^T * D) V', S_in the state entering the chunk, D_rs = exp(G_r - G_s), s <= r.
//  gdn_wy_prep (grid chunk x value head): gamma = cumsum(g), K K^T, the unit lower triangular solve in fp32
//      registers (one column of [U | W] per thread). Writes gamma, U (fp32), -W (fp16 hi/lo) and, once per key
//      head, K (fp16 hi/lo).
//  gdn_wy_scan (grid value head x dv slice x sequence, sequential over the chunks): the fp32 state in the
//      accumulators of the warps owning its rows. Per chunk: V' = U + (-W) S (the accumulator starts from U),
//      written over U; S = exp(G_last) S + K^T Vd; the state entering the chunk goes out as fp16 hi/lo.
//  gdn_wy_out (grid chunk x value head): Q K^T * D into shared memory, then per 32 columns of the output
//      exp(G) (Q S_in) + (Q K^T * D) V', rows < n.
// Each product takes fp16 operands with fp32 accumulation, in 3 passes (x = hi + lo, two fp16 halves; hi*hi +
// hi*lo + lo*hi: fp32-grade, ~2^-22) or 1 (hi*hi: each operand rounded once), per WY_*_PASSES below. This file
// builds every product in three (the exact variant); gated_delta_wy_fast.cu sets fast's choice
// (docs/studies/gdn_wy_precision.py measured which products may round, and what that costs).
// Tail chunks are zero-padded (k = v = beta = g = 0), which is exact. Only non-positive numbers are exponentiated.
// Fragments are loaded with .shared addressing (mma_sm70.cuh: ldmatrix on sm_75+). Each kernel is one template
// body on (dk, dv): the plain entry takes them at run time (multiples of 16 up to 128), _d128 fixes both at 128.
// sm_70: wmma m16n16k16 only, <= 96 KB of shared memory per block (gdn_wy_out: 94.5 KB at dk = 128).
#include "gdn_tiles.cuh"

#define GC 64          // chunk
#define GTH 256        // threads per block (8 warps)
#define LA (GC + 4)    // row stride (floats) of A^T in the solve: float4 rows
#define LP (GC + 8)    // row stride (halves) of Q K^T * D hi / lo
#define OW 32          // gdn_wy_out: output columns per piece
#define LO (OW + 8)    // row stride (halves) of a piece of S_in and V'

#ifndef WY_KK_PASSES
#define WY_KK_PASSES 3     // K K^T (the solve's A)
#endif
#ifndef WY_SCAN_PASSES
#define WY_SCAN_PASSES 3   // W S and K^T Vd (the state recurrence)
#endif
#ifndef WY_QS_PASSES
#define WY_QS_PASSES 3     // Q S_in
#endif
#ifndef WY_QK_PASSES
#define WY_QK_PASSES 3     // Q K^T
#endif
#ifndef WY_PV_PASSES
#define WY_PV_PASSES 3     // (Q K^T * D) V'
#endif
// which stored operands need their lo halves
#define WY_K_LO (WY_SCAN_PASSES == 3 || WY_QK_PASSES == 3)
#define WY_Q_LO (WY_QS_PASSES == 3 || WY_QK_PASSES == 3)

enum { RR, RC, CR };   // (A, B) layouts: row.row, row.col, col.row
// d += (ah + al)(bh + bl) less al * bl (P = 3), or d += ah bh (P = 1: the lo fragments are not read)
template <int P, int L>
__device__ __forceinline__ void mma_p(FragC& d, const FragA& ah, const FragA& al, const FragB& bh, const FragB& bl) {
    if (L == RR) { mma_row_row(d, ah, bh); if (P == 3) { mma_row_row(d, ah, bl); mma_row_row(d, al, bh); } }
    if (L == RC) { mma_row_col(d, ah, bh); if (P == 3) { mma_row_col(d, ah, bl); mma_row_col(d, al, bh); } }
    if (L == CR) { mma_col_row(d, ah, bh); if (P == 3) { mma_col_row(d, ah, bl); mma_col_row(d, al, bh); } }
}
// a fragment's hi half at shared address a and, for P = 3, its lo half lo bytes further (ld in halves)
template <int P>
__device__ __forceinline__ void lda_row_p(FragA& h, FragA& l, unsigned a, unsigned lo, unsigned ld) {
    lda_row(h, a, ld);
    if (P == 3) lda_row(l, a + lo, ld);
}
template <int P>
__device__ __forceinline__ void lda_col_p(FragA& h, FragA& l, unsigned a, unsigned lo, unsigned ld) {
    lda_col(h, a, ld);
    if (P == 3) lda_col(l, a + lo, ld);
}
template <int P>
__device__ __forceinline__ void ldb_row_p(FragB& h, FragB& l, unsigned a, unsigned lo, unsigned ld) {
    ldb_row(h, a, ld);
    if (P == 3) ldb_row(l, a + lo, ld);
}
template <int P>
__device__ __forceinline__ void ldb_col_p(FragB& h, FragB& l, unsigned a, unsigned lo, unsigned ld) {
    ldb_col(h, a, ld);
    if (P == 3) ldb_col(l, a + lo, ld);
}
// 8 consecutive fp32 -> hi halves, and lo halves when LOW
template <bool LOW>
__device__ __forceinline__ void store8(half_t* hi, half_t* lo, const float* x) {
    if (LOW) store8_hl(hi, lo, x);
    else store8_h(hi, x);
}
// the lower 16-blocks of a 64 x 64 product, two per warp: block t < 10 -> (row block, column block)
__device__ __forceinline__ int tri_row(int t) { return (t >= 1) + (t >= 3) + (t >= 6); }

// Workspace, slot base = c * hv + h (chunk c of the launch's group, value head h), kbase = c * hk + kh:
//   Gw [base][GC] fp32 gamma;  Uw [base][GC][dv] fp32 U, then V';  Ww [base][hi, lo][GC][dk] -W;
//   Kw [kbase][hi, lo][GC][dk] K;  Hw [base][hi, lo][dk][dv] the state entering the chunk.
// A lo half that no product reads is neither written nor read.

// ---------------------------------------------------------------------------------------------- gdn_wy_prep
// Shared memory (bytes), LK = dk + 8: RK max(4*GC*LK, 4*GC*LA) K hi/lo, then A^T fp32 for the solve;
// ST 8 warps * 1 KB accumulator staging; VEC 4*GC*3: gamma, beta, exp(gamma).
// dk = 128: 34816 + 8192 + 1024 = 44032.
template <int DK, int DV>
__device__ __forceinline__ void wy_prep_body(
    const float* __restrict__ k, const float* __restrict__ v, long long vs, const float* __restrict__ g,
    const float* __restrict__ beta, const int4* __restrict__ chunks, int hk, int hv, int dk_, int dv_,
    float* __restrict__ Gw, float* __restrict__ Uw, half_t* __restrict__ Ww, half_t* __restrict__ Kw) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int dk = DK ? DK : dk_, dv = DV ? DV : dv_;
    const int LK = dk + 8;
    const int oST = max(4 * GC * LK, 4 * GC * LA), oV = oST + 8192;
    half_t* Kh = (half_t*)smem;
    half_t* Kl = Kh + GC * LK;
    float* gam = (float*)(smem + oV);
    float* bet = gam + GC;
    float* eg = bet + GC;
    const int c = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    float* stage = (float*)(smem + oST) + warp * 256;
    const unsigned sK = sa(smem);
    const int4 ch = chunks[c];
    const int t0 = ch.x, n = ch.y, rep = hv / hk, kh = h / rep;
    const long long base = (long long)c * hv + h;
    half_t* kw = Kw + ((long long)c * hk + kh) * 2 * GC * dk;
    const bool kout = h % rep == 0;   // the first value head of each key head writes K

    if (tid < GC) {
        gam[tid] = tid < n ? g[(long long)(t0 + tid) * hv + h] : 0.f;
        bet[tid] = tid < n ? beta[(long long)(t0 + tid) * hv + h] : 0.f;
    }
    __syncthreads();
    if (tid == 0) {   // sequential fp32 cumsum, as numpy's
        float acc = 0.f;
#pragma unroll
        for (int r = 0; r < GC; ++r) {
            acc += gam[r];
            gam[r] = acc;
        }
    }
#pragma unroll 4
    for (int e = tid; e < GC * dk / 4; e += GTH) {     // K rows -> hi/lo (rows >= n: 0)
        const int r = e / (dk / 4), d = (e % (dk / 4)) * 4;
        const float4 x = chunk_row4(k + ((long long)t0 * hk + kh) * dk + d, r, n, hk * dk);
        store4_hl(Kh + r * LK + d, Kl + r * LK + d, x);
        if (kout) {
            unsigned lo0, lo1;
            const unsigned h0 = hl_pair(x.x, x.y, lo0), h1 = hl_pair(x.z, x.w, lo1);
            *(uint2*)(kw + r * dk + d) = make_uint2(h0, h1);
            if (WY_K_LO) *(uint2*)(kw + GC * dk + r * dk + d) = make_uint2(lo0, lo1);
        }
    }
    __syncthreads();
    if (tid < GC) {
        eg[tid] = expf(gam[tid]);
        Gw[base * GC + tid] = gam[tid];
    }
    // K K^T on the 10 lower 16-blocks
    FragC akk[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int t = warp + 8 * i, ri = tri_row(t), ci = t - ri * (ri + 1) / 2;
        if (t >= 10) break;
        frag_zero(akk[i]);
        for (int kk = 0; kk < dk / 16; ++kk) {
            FragA ah, al;
            FragB bh, bl;
            ldb_col_p<WY_KK_PASSES>(bh, bl, sK + 2 * (ci * 16 * LK + kk * 16), 2 * GC * LK, LK);
            lda_row_p<WY_KK_PASSES>(ah, al, sK + 2 * (ri * 16 * LK + kk * 16), 2 * GC * LK, LK);
            mma_p<WY_KK_PASSES, RC>(akk[i], ah, al, bh, bl);
        }
    }
    __syncthreads();   // K hi/lo dead: RK becomes A^T (eg complete)
    float* At = (float*)smem;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int t = warp + 8 * i, ri = tri_row(t), ci = t - ri * (ri + 1) / 2;
        if (t >= 10) break;
        const int r = ri * 16 + (lane >> 1), s0 = ci * 16 + (lane & 1) * 8;
        const float* sr = stage + (lane >> 1) * 16 + (lane & 1) * 8;
        stc_row(sa(stage), akk[i], 16);
        __syncwarp();
#pragma unroll 1
        for (int e = 0; e < 8; ++e) {   // A^T: A = beta k k^T * D, strictly lower (mask before exp)
            const int s = s0 + e;
            At[s * LA + r] = s < r ? bet[r] * sr[e] * expf(gam[r] - gam[s]) : 0.f;
        }
        __syncwarp();
    }
    // (I + A) X = [beta V | beta Gamma K]: thread j owns column j of X in registers
    const bool isv = tid < dv, col = tid < dv + dk;
    float x[GC];
    {   // all 64 loads issued before the first is used: rows past the chunk read its last row (n >= 1), then
        // zeroed; threads past dv + dk read column 0 (their x is never used)
        const float* p = (isv ? v + (long long)h * dv + tid : k + (long long)kh * dk + (col ? tid - dv : 0));
        const int st = isv ? (int)vs : hk * dk;   // a row stride: 32 bits (offsets within the chunk)
        p += (long long)t0 * st;
#pragma unroll
        for (int r = 0; r < GC; ++r) x[r] = p[min(r, n - 1) * st];
#pragma unroll
        for (int r = 0; r < GC; ++r) x[r] = r < n ? x[r] * (isv ? bet[r] : bet[r] * eg[r]) : 0.f;
    }
    __syncthreads();   // A^T complete
    const float4* At4 = (const float4*)smem;
#pragma unroll
    for (int c2 = 0; c2 < GC - 1; ++c2) {      // right-looking: row r -= A[r][c2] x[c2], independent over r
#pragma unroll
        for (int r4 = (c2 + 1) >> 2; r4 < GC / 4; ++r4) {
            const float4 a = At4[c2 * (LA / 4) + r4];
            if (4 * r4 + 0 > c2) x[4 * r4 + 0] = fmaf(-a.x, x[c2], x[4 * r4 + 0]);
            if (4 * r4 + 1 > c2) x[4 * r4 + 1] = fmaf(-a.y, x[c2], x[4 * r4 + 1]);
            if (4 * r4 + 2 > c2) x[4 * r4 + 2] = fmaf(-a.z, x[c2], x[4 * r4 + 2]);
            x[4 * r4 + 3] = fmaf(-a.w, x[c2], x[4 * r4 + 3]);
        }
    }
    if (isv) {                      // U, fp32 (coalesced over the threads: one row at a time)
        float* u = Uw + base * GC * dv + tid;
#pragma unroll
        for (int r = 0; r < GC; ++r) u[r * dv] = x[r];
    } else if (col) {               // -W: negated, so that gdn_wy_scan's accumulator starts from U and adds
        half_t* w = Ww + base * 2 * GC * dk + (tid - dv);
#pragma unroll
        for (int r = 0; r < GC; ++r) {
            const half_t hh = f2h(-x[r]);
            w[r * dk] = hh;
            if (WY_SCAN_PASSES == 3) w[GC * dk + r * dk] = f2h(-x[r] - h2f(hh));
        }
    }
}

#define WY_PREP_ARGS                                                                                            \
    const float* __restrict__ k, const float* __restrict__ v, long long vs, const float* __restrict__ g,        \
        const float* __restrict__ beta, const int4* __restrict__ chunks, int hk, int hv, int dk, int dv,         \
        float* __restrict__ Gw, float* __restrict__ Uw, half_t* __restrict__ Ww, half_t* __restrict__ Kw
extern "C" __global__ void __launch_bounds__(GTH, 2) gdn_wy_prep(WY_PREP_ARGS) {
    wy_prep_body<0, 0>(k, v, vs, g, beta, chunks, hk, hv, dk, dv, Gw, Uw, Ww, Kw);
}
extern "C" __global__ void __launch_bounds__(GTH, 2) gdn_wy_prep_d128(WY_PREP_ARGS) {
    wy_prep_body<128, 128>(k, v, vs, g, beta, chunks, hk, hv, dk, dv, Gw, Uw, Ww, Kw);
}

// ---------------------------------------------------------------------------------------------- gdn_wy_scan
// seqs[b] = (first chunk, end chunk, zero_state, state slot); grid (hv, dv / BV, nseq), BV = 16 or 32.
// Warp w < dk/16 owns state rows [16w, 16w + 16) x BV columns: fp32 accumulators for the whole sequence. Warp
// w < 4 * BV/16 computes the V' tile (row block w & 3, column block w >> 2). Per chunk:
//   -W -> X (from registers fetched a chunk ahead), K fetched into registers; S -> Ss hi/lo and Hw; sync;
//   V' = U + (-W) Ss (two accumulator chains, even and odd k steps) -> Uw, Vd = V' exp(G_last - G) -> Vs hi/lo;
//   sync; K -> X, the next chunk's -W fetched into registers; sync; S = exp(G_last) S + K^T Vs; sync.
// Shared memory (bytes), LK = dk + 8, LS = BV + 8: X 4*GC*LK + Ss 4*dk*LS + Vs 4*GC*LS + 8 KB staging + EV
// 4*(GC + 4) (exp(G_last - G_r), exp(G_last)). dk = 128, BV = 32: 34816 + 20480 + 10240 + 8192 + 272 = 74000.
template <int DK, int DV>
__device__ __forceinline__ void wy_scan_body(
    const int4* __restrict__ seqs, int hk, int hv, int dk_, int dv_, int BV, const float* __restrict__ Gw,
    float* __restrict__ Uw, const half_t* __restrict__ Ww, const half_t* __restrict__ Kw, float* __restrict__ state,
    half_t* __restrict__ Hw) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int dk = DK ? DK : dk_, dv = DV ? DV : dv_;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, rr = lane >> 1, c0 = (lane & 1) * 8;
    const int LK = dk + 8, LS = BV + 8, NK = dk / 16, NB = BV / 16;
    half_t* Xs = (half_t*)smem;                                // [hi, lo][GC][LK]: -W, then K
    half_t* Ss = Xs + 2 * GC * LK;                             // [hi, lo][dk][LS]
    half_t* Vs = Ss + 2 * dk * LS;                             // [hi, lo][GC][LS]
    float* stage = (float*)(Vs + 2 * GC * LS) + warp * 256;
    float* ev = (float*)(Vs + 2 * GC * LS) + 8 * 256;          // [GC + 1]
    const unsigned sX = sa(smem), sS = sX + 4 * GC * LK, sV = sS + 4 * dk * LS;
    const int h = blockIdx.x, j0 = blockIdx.y * BV, kh = h / (hv / hk);
    const int4 sq = seqs[blockIdx.z];
    float* gst = state + ((long long)sq.w * hv + h) * dk * dv + j0;
    const bool own = warp < NK, vown = warp < 4 * NB;
    const int vrb = warp & 3, vcb = warp >> 2;
    // -W or K of one chunk: (2 halves with WY_SCAN_PASSES 3) x GC x dk fp16 = nx uint4, <= 8 per thread
    const int nx = (WY_SCAN_PASSES == 3 ? 2 : 1) * GC * dk / 8, nrow = GC * dk / 8;
    uint4 pf[8];
    auto fetch = [&](const half_t* src) {
        const uint4* m = (const uint4*)src;
#pragma unroll
        for (int i = 0; i < 8; ++i)
            if (tid + i * GTH < nx) pf[i] = m[tid + i * GTH];
    };
    auto put = [&]() {   // pf -> Xs (global rows of dk halves -> shared rows of LK)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int e = tid + i * GTH;
            if (e < nx) {
                const int hl = e / nrow, rem = e - hl * nrow;
                *(uint4*)(Xs + hl * GC * LK + (rem / (dk / 8)) * LK + (rem % (dk / 8)) * 8) = pf[i];
            }
        }
    };
    auto put_state = [&](const FragC (&S)[2], long long base) {   // S -> Ss hi/lo and Hw[base]
        half_t* sh = Ss + (warp * 16 + rr) * LS + c0;
        half_t* gh = Hw + base * 2 * dk * dv + (warp * 16 + rr) * dv + j0 + c0;
#pragma unroll
        for (int cb = 0; cb < 2; ++cb) {
            if (cb >= NB) break;
            float x[8];
            tile_to_lane(stage, S[cb], x);
            store8<WY_SCAN_PASSES == 3>(sh + cb * 16, sh + dk * LS + cb * 16, x);
            store8<WY_QS_PASSES == 3>(gh + cb * 16, gh + dk * dv + cb * 16, x);
        }
    };

    FragC S[2];
    long long base = (long long)sq.x * hv + h;
    fetch(Ww + base * 2 * GC * dk);
    if (own) {
#pragma unroll
        for (int cb = 0; cb < 2; ++cb) {
            if (cb >= NB) break;
            if (sq.z) frag_zero(S[cb]);
            else load_c_row(S[cb], gst + warp * 16 * dv + cb * 16, dv);
        }
    }
    float gr = 0.f, gl = 0.f;   // gamma of this thread's row (tid < GC) and of the chunk's last row, a chunk ahead
    if (tid < GC) {
        gr = Gw[base * GC + tid];
        gl = Gw[base * GC + GC - 1];
    }
    for (int cc = sq.x; cc < sq.y; ++cc) {
        base = (long long)cc * hv + h;
        float* ut = Uw + (base * GC + vrb * 16) * dv + j0 + vcb * 16;   // the V' tile's U (vown)
        FragC acc, acc2;
        if (vown) {
            load_c_row(acc, ut, dv);
            frag_zero(acc2);
        }
        put();                                                    // -W of chunk cc
        fetch(Kw + ((long long)cc * hk + kh) * 2 * GC * dk);        // K of chunk cc, in flight through V'
        if (own) put_state(S, base);
        if (tid < GC) {
            ev[tid] = expf(gl - gr);
            if (tid == 0) ev[GC] = expf(gl);
            if (cc + 1 < sq.y) {
                gr = Gw[(base + hv) * GC + tid];
                gl = Gw[(base + hv) * GC + GC - 1];
            }
        }
        __syncthreads();   // Xs = -W, Ss = S, ev
        if (vown) {
            for (int kk = 0; kk < NK; kk += 2) {   // even k steps into acc, odd into acc2: two shorter chains
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    if (kk + j >= NK) break;
                    FragA ah, al;
                    FragB bh, bl;
                    lda_row_p<WY_SCAN_PASSES>(ah, al, sX + 2 * (vrb * 16 * LK + (kk + j) * 16), 2 * GC * LK, LK);
                    ldb_row_p<WY_SCAN_PASSES>(bh, bl, sS + 2 * ((kk + j) * 16 * LS + vcb * 16), 2 * dk * LS, LS);
                    mma_p<WY_SCAN_PASSES, RR>(j ? acc2 : acc, ah, al, bh, bl);
                }
            }
#pragma unroll
            for (int e = 0; e < 8; ++e) acc.x[e] += acc2.x[e];
            float x[8];
            tile_to_lane(stage, acc, x);
            float4* o = (float4*)(ut + rr * dv + c0);                // V' over U
            o[0] = make_float4(x[0], x[1], x[2], x[3]);
            o[1] = make_float4(x[4], x[5], x[6], x[7]);
            const float f = ev[vrb * 16 + rr];
#pragma unroll
            for (int i = 0; i < 8; ++i) x[i] *= f;
            half_t* vd = Vs + (vrb * 16 + rr) * LS + vcb * 16 + c0;
            store8<WY_SCAN_PASSES == 3>(vd, vd + GC * LS, x);
        }
        __syncthreads();   // -W and Ss consumed; Vs complete
        put();             // K of chunk cc
        if (cc + 1 < sq.y) fetch(Ww + (base + hv) * 2 * GC * dk);
        __syncthreads();   // Xs = K
        if (own) {
            const float eL = ev[GC];
#pragma unroll
            for (int cb = 0; cb < 2; ++cb) {
                if (cb >= NB) break;
#pragma unroll
                for (int e = 0; e < 8; ++e) S[cb].x[e] *= eL;
            }
#pragma unroll
            for (int kk = 0; kk < GC / 16; ++kk) {
                FragA ah, al;
                lda_col_p<WY_SCAN_PASSES>(ah, al, sX + 2 * (kk * 16 * LK + warp * 16), 2 * GC * LK, LK);
#pragma unroll
                for (int cb = 0; cb < 2; ++cb) {
                    if (cb >= NB) break;
                    FragB bh, bl;
                    ldb_row_p<WY_SCAN_PASSES>(bh, bl, sV + 2 * (kk * 16 * LS + cb * 16), 2 * GC * LS, LS);
                    mma_p<WY_SCAN_PASSES, CR>(S[cb], ah, al, bh, bl);
                }
            }
        }
        __syncthreads();   // K, Vs and ev consumed
    }
    if (own) {
#pragma unroll
        for (int cb = 0; cb < 2; ++cb)
            if (cb < NB) store_c_row(gst + warp * 16 * dv + cb * 16, S[cb], dv);
    }
}

#define WY_SCAN_ARGS                                                                                            \
    const int4* __restrict__ seqs, int hk, int hv, int dk, int dv, int BV, const float* __restrict__ Gw,        \
        float* __restrict__ Uw, const half_t* __restrict__ Ww, const half_t* __restrict__ Kw,                    \
        float* __restrict__ state, half_t* __restrict__ Hw
extern "C" __global__ void __launch_bounds__(GTH, 1) gdn_wy_scan(WY_SCAN_ARGS) {
    wy_scan_body<0, 0>(seqs, hk, hv, dk, dv, BV, Gw, Uw, Ww, Kw, state, Hw);
}
extern "C" __global__ void __launch_bounds__(GTH, 1) gdn_wy_scan_d128(WY_SCAN_ARGS) {
    wy_scan_body<128, 128>(seqs, hk, hv, dk, dv, BV, Gw, Uw, Ww, Kw, state, Hw);
}

// ----------------------------------------------------------------------------------------------- gdn_wy_out
// grid (chunks, hv). Q hi/lo from q; K hi/lo from Kw; P = (Q K^T) * D on the lower 16-blocks (warps t, t + 8 of
// the 10), hi/lo; then per piece of OW columns: S_in and V' of those columns (hi/lo) where K was, and warp w
// computes row block w & 3 x column block w >> 2: exp(G_r) (Q S_in) + P V' (P is block lower triangular).
// Shared memory (bytes), LK = dk + 8: Q 4*GC*LK + RK max(4*GC*LK, 4*(dk + GC)*LO) + P 4*GC*LP + 8 KB staging +
// 8*GC (gamma, exp(gamma)). dk = 128: 34816 + 34816 + 18432 + 8192 + 512 = 96768 <= 98304 (sm_70's limit).
template <int DK, int DV>
__device__ __forceinline__ void wy_out_body(
    const float* __restrict__ q, const int4* __restrict__ chunks, int hk, int hv, int dk_, int dv_,
    const float* __restrict__ Gw, const float* __restrict__ Uw, const half_t* __restrict__ Kw,
    const half_t* __restrict__ Hw, float* __restrict__ out) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int dk = DK ? DK : dk_, dv = DV ? DV : dv_;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, rr = lane >> 1, c0 = (lane & 1) * 8;
    const int LK = dk + 8;
    const int oK = 4 * GC * LK, oP = oK + max(4 * GC * LK, 4 * (dk + GC) * LO), oST = oP + 4 * GC * LP;
    const int oV = oST + 8192;
    half_t* Qh = (half_t*)smem;                    // [hi, lo][GC][LK]
    half_t* Kh = (half_t*)(smem + oK);             // [hi, lo][GC][LK]
    half_t* Sh = Kh;                               // then [hi, lo][dk][LO]: S_in of the piece's columns
    half_t* Vh = Kh + 2 * dk * LO;                 //  and [hi, lo][GC][LO]: V' of the piece's columns
    half_t* Ph = (half_t*)(smem + oP);             // [hi, lo][GC][LP]
    float* stage = (float*)(smem + oST) + warp * 256;
    float* gam = (float*)(smem + oV);
    float* eg = gam + GC;
    const unsigned sQ = sa(smem), sK = sQ + oK, sS = sK, sV = sK + 4 * dk * LO, sP = sQ + oP;
    const int c = blockIdx.x, h = blockIdx.y, kh = h / (hv / hk);
    const long long base = (long long)c * hv + h;
    const int4 ch = chunks[c];
    const int t0 = ch.x, n = ch.y;

    if (tid < GC) {
        const float gv = Gw[base * GC + tid];
        gam[tid] = gv;
        eg[tid] = expf(gv);
    }
#pragma unroll 4
    for (int e = tid; e < GC * dk / 4; e += GTH) {     // Q rows -> hi/lo (rows >= n: 0)
        const int r = e / (dk / 4), d = (e % (dk / 4)) * 4;
        const float4 x = chunk_row4(q + ((long long)t0 * hk + kh) * dk + d, r, n, hk * dk);
        if (WY_Q_LO) {
            store4_hl(Qh + r * LK + d, Qh + GC * LK + r * LK + d, x);
        } else {
            *(uint2*)(Qh + r * LK + d) = make_uint2(pack2h(x.x, x.y), pack2h(x.z, x.w));
        }
    }
    {
        const half_t* kw = Kw + ((long long)c * hk + kh) * 2 * GC * dk;
        const int nrow = GC * dk / 8;
#pragma unroll 4
        for (int e = tid; e < (WY_QK_PASSES == 3 ? 2 : 1) * nrow; e += GTH) {   // K hi(/lo): rows of dk -> LK
            const int hl = e / nrow, rem = e - hl * nrow;
            *(uint4*)(Kh + hl * GC * LK + (rem / (dk / 8)) * LK + (rem % (dk / 8)) * 8) = ((const uint4*)kw)[e];
        }
    }
    __syncthreads();
    // P = (Q K^T) * D on the 10 lower 16-blocks (blocks above the diagonal are never read)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int t = warp + 8 * i, ri = tri_row(t), ci = t - ri * (ri + 1) / 2;
        if (t >= 10) break;
        FragC acc;
        frag_zero(acc);
        for (int kk = 0; kk < dk / 16; ++kk) {
            FragA ah, al;
            FragB bh, bl;
            ldb_col_p<WY_QK_PASSES>(bh, bl, sK + 2 * (ci * 16 * LK + kk * 16), 2 * GC * LK, LK);
            lda_row_p<WY_QK_PASSES>(ah, al, sQ + 2 * (ri * 16 * LK + kk * 16), 2 * GC * LK, LK);
            mma_p<WY_QK_PASSES, RC>(acc, ah, al, bh, bl);
        }
        const int r = ri * 16 + rr, s0 = ci * 16 + c0;
        const float* sr = stage + rr * 16 + c0;
        stc_row(sa(stage), acc, 16);
        __syncwarp();
#pragma unroll 1
        for (int e = 0; e < 8; ++e) {   // D: mask before exp
            const int s = s0 + e;
            const float y = s <= r ? sr[e] * expf(gam[r] - gam[s]) : 0.f;
            const half_t hh = f2h(y);
            Ph[r * LP + s] = hh;
            if (WY_PV_PASSES == 3) Ph[GC * LP + r * LP + s] = f2h(y - h2f(hh));
        }
        __syncwarp();
    }
    __syncthreads();   // K dead: its region takes the pieces; P complete
    const int rb = warp & 3, cb = warp >> 2, r = rb * 16 + rr;
    for (int j0 = 0; j0 < dv; j0 += OW) {
        const int ncol = min(OW, dv - j0);
        {
            const half_t* hs = Hw + base * 2 * dk * dv + j0;
            const int per = dk * ncol / 8;
            for (int e = tid; e < (WY_QS_PASSES == 3 ? 2 : 1) * per; e += GTH) {   // S_in hi(/lo)
                const int hl = e / per, rem = e - hl * per, row = rem / (ncol / 8), j = (rem % (ncol / 8)) * 8;
                *(uint4*)(Sh + hl * dk * LO + row * LO + j) = *(const uint4*)(hs + hl * dk * dv + row * dv + j);
            }
            const float* u = Uw + base * GC * dv + j0;
            for (int e = tid; e < GC * ncol / 4; e += GTH) {                        // V' fp32 -> hi(/lo)
                const int row = e / (ncol / 4), j = (e % (ncol / 4)) * 4;
                const float4 x = *(const float4*)(u + row * dv + j);
                if (WY_PV_PASSES == 3) {
                    store4_hl(Vh + row * LO + j, Vh + GC * LO + row * LO + j, x);
                } else {
                    *(uint2*)(Vh + row * LO + j) = make_uint2(pack2h(x.x, x.y), pack2h(x.z, x.w));
                }
            }
        }
        __syncthreads();
        if (cb * 16 < ncol) {
            FragC a1, a2;
            frag_zero(a1);
            frag_zero(a2);
            for (int kk = 0; kk < dk / 16; ++kk) {
                FragA ah, al;
                FragB bh, bl;
                lda_row_p<WY_QS_PASSES>(ah, al, sQ + 2 * (rb * 16 * LK + kk * 16), 2 * GC * LK, LK);
                ldb_row_p<WY_QS_PASSES>(bh, bl, sS + 2 * (kk * 16 * LO + cb * 16), 2 * dk * LO, LO);
                mma_p<WY_QS_PASSES, RR>(a1, ah, al, bh, bl);
            }
            for (int kk = 0; kk <= rb; ++kk) {
                FragA ah, al;
                FragB bh, bl;
                lda_row_p<WY_PV_PASSES>(ah, al, sP + 2 * (rb * 16 * LP + kk * 16), 2 * GC * LP, LP);
                ldb_row_p<WY_PV_PASSES>(bh, bl, sV + 2 * (kk * 16 * LO + cb * 16), 2 * GC * LO, LO);
                mma_p<WY_PV_PASSES, RR>(a2, ah, al, bh, bl);
            }
            float x1[8], x2[8];
            tile_to_lane(stage, a1, x1);
            tile_to_lane(stage, a2, x2);
            if (r < n) {
                const float e = eg[r];
                float4* o = (float4*)(out + ((long long)(t0 + r) * hv + h) * dv + j0 + cb * 16 + c0);
                o[0] = make_float4(fmaf(e, x1[0], x2[0]), fmaf(e, x1[1], x2[1]), fmaf(e, x1[2], x2[2]),
                                   fmaf(e, x1[3], x2[3]));
                o[1] = make_float4(fmaf(e, x1[4], x2[4]), fmaf(e, x1[5], x2[5]), fmaf(e, x1[6], x2[6]),
                                   fmaf(e, x1[7], x2[7]));
            }
        }
        __syncthreads();   // the piece consumed before the next one overwrites it
    }
}

#define WY_OUT_ARGS                                                                                             \
    const float* __restrict__ q, const int4* __restrict__ chunks, int hk, int hv, int dk, int dv,               \
        const float* __restrict__ Gw, const float* __restrict__ Uw, const half_t* __restrict__ Kw,               \
        const half_t* __restrict__ Hw, float* __restrict__ out
extern "C" __global__ void __launch_bounds__(GTH, 2) gdn_wy_out(WY_OUT_ARGS) {
    wy_out_body<0, 0>(q, chunks, hk, hv, dk, dv, Gw, Uw, Kw, Hw, out);
}
extern "C" __global__ void __launch_bounds__(GTH, 2) gdn_wy_out_d128(WY_OUT_ARGS) {
    wy_out_body<128, 128>(q, chunks, hk, hv, dk, dv, Gw, Uw, Kw, Hw, out);
}
