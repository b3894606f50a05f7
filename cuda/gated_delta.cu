// Chunked (WY / UT) gated delta rule on fp16 tensor cores, chunk C = 64, fp32 state and solve.
//
// numpy twin: clefcore/backends/cpu.py::gated_delta_rule (spec: qwen35-backbone.md §4), state carried in and out.
//
// Per chunk (numpy names): U = U~ - W S, O = Qg S + QKD U, S' = Gn S + Kd^T U. Everything that does not involve
// S is folded per chunk, so the only sequential work is one product with the state:
//     S' = S + N + M' S      with N  = Kd^T U~,  M' = (Gn - 1) I - Kd^T W
//     O  = O' + Q' S         with O' = QKD U~,   Q' = Qg - QKD W
//  gdn_prep (grid chunk x value head, parallel): gamma = cumsum(g); K K^T and Q K^T; the unit lower triangular
//           solve (I + A) [U~ | W] = [beta V | beta Gamma K] in fp32 registers (one column per thread); then
//           O' (into out), N, M', Q'.
//  gdn_scan (grid value head x dv slice x sequence, sequential over chunks): S' = S + N + M' S, the fp32 state
//           kept in the accumulators of the warps owning its rows, M' staged in shared memory one chunk ahead;
//           writes the state entering each chunk.
//  gdn_out  (grid chunk x value head x 64 columns, parallel): out += Q' S_chunk.
// Tensor-core operands are fp32 values split x = hi + lo (two fp16); hi*hi + hi*lo + lo*hi keeps a product
// fp32-grade (~2^-22; dropping lo*hi measured 3.5e-4 relative error on the output, over the 2e-4 test bound).
// GDN_PASSES 1 (gated_delta_fast.cu, the fast precision) keeps hi*hi only: one fp16 rounding of each operand,
// ~5e-4 of the output at the model's head shapes (docs/studies/gdn_fp16_operands.py); solve and state stay fp32.
// Tail chunks are zero-padded (k = v = beta = g = 0), which is exact. Only non-positive numbers are exponentiated.
// Fragments are loaded with .shared addressing (mma_sm70.cuh: ldmatrix on sm_75+).
// Each kernel is one template body on (dk, dv): the plain entry takes them at run time (any multiple of 16 up
// to 128), the _d128 entry fixes both at 128, the model's size, so index arithmetic and loop bounds fold.
// sm_70: wmma m16n16k16 only, <= 96 KB shared memory per block (gdn_prep: 95 KB at dk = dv = 128).
#include "gdn_tiles.cuh"

#define GC 64          // chunk
#define GTH 256        // threads per block (8 warps)
#define LA (GC + 4)    // row stride (floats) of A^T in the solve: float4 rows
#define LP (GC + 8)    // row stride (halves) of QKD hi / lo
#if __CUDA_ARCH__ >= 800
#define PREP_BLOCKS 2  // two blocks per SM (2 x 95 KB of shared memory): needs <= 128 registers
#else
#define PREP_BLOCKS 1  // 96 KB of shared memory per SM on sm_70
#endif

#ifndef GDN_PASSES
#define GDN_PASSES 3   // tensor-core passes per product: 3 (hi/lo, fp32-grade) or 1 (hi only)
#endif

enum { RR, RC, CR };   // (A, B) layouts: row.row, row.col, col.row
// d += (ah + al)(bh + bl) less the al * bl term; with GDN_PASSES 1, d += ah bh
template <int L>
__device__ __forceinline__ void mma3(FragC& d, const FragA& ah, const FragA& al, const FragB& bh, const FragB& bl) {
    if (L == RR) { mma_row_row(d, ah, bh); if (GDN_PASSES == 3) { mma_row_row(d, ah, bl); mma_row_row(d, al, bh); } }
    if (L == RC) { mma_row_col(d, ah, bh); if (GDN_PASSES == 3) { mma_row_col(d, ah, bl); mma_row_col(d, al, bh); } }
    if (L == CR) { mma_col_row(d, ah, bh); if (GDN_PASSES == 3) { mma_col_row(d, ah, bl); mma_col_row(d, al, bh); } }
}

// accumulator registers <-> 32 bytes per lane (layout private to the fragment type: written and read only so);
// registers 0-3 of all lanes first, then 4-7, so that each 16-byte access of the warp is one contiguous 512 bytes
__device__ __forceinline__ void frag_raw_store(float* p, const FragC& c) {
    float4* q = (float4*)p + (threadIdx.x & 31);
    q[0] = make_float4(c.x[0], c.x[1], c.x[2], c.x[3]);
    q[32] = make_float4(c.x[4], c.x[5], c.x[6], c.x[7]);
}
__device__ __forceinline__ void frag_raw_load(FragC& c, const float* p) {
    const float4* q = (const float4*)p + (threadIdx.x & 31);
    const float4 a = q[0], b = q[32];
    c.x[0] = a.x; c.x[1] = a.y; c.x[2] = a.z; c.x[3] = a.w; c.x[4] = b.x; c.x[5] = b.y; c.x[6] = b.z; c.x[7] = b.w;
}
// ------------------------------------------------------------------------------------------------- gdn_prep
// Shared memory (bytes), LK = dk + 8, LX = max(dk, dv) + 8 (row padding: conflict-free ldmatrix):
//   RK  4*GC*LK                 K hi/lo (K K^T, Q K^T); after the solve Kd = K * exp(gamma_n - gamma) hi/lo
//   RX  max(4*GC*LX, 4*GC*LA)   Q hi/lo (row stride LK); then A^T fp32 for the solve; then U~, later W, hi/lo
//   RP  4*GC*LP                 QKD hi/lo
//   ST  8 warps * 1 KB          accumulator staging;  VEC 4*GC*4: gamma, beta, exp(gamma), exp(gamma_n - gamma)
// dk = dv = 128: 34816 + 34816 + 18432 + 8192 + 1024 = 97280 <= 98304 (the sm_70 opt-in limit).

// Products of one half of X = [U~ | W] (WPART: the W half, dk columns; else U~, dv columns) in RX:
// "top" tiles: QKD X (64 rows; QKD is lower triangular by 16-blocks: k-blocks <= the row block);
// the others: Kd^T X (dk rows). An item is one row block x up to 4 column tiles: the A fragments are shared and
// the 4 accumulator chains run side by side.
//   U~ half: top -> O' rows < n into out; others -> N (raw accumulator registers, read back by gdn_scan).
//   W half:  top -> Q' = Qg - QKD W (hi/lo); others -> M' = (Gn - 1) I - Kd^T W (hi/lo).
template <bool WPART>
__device__ __forceinline__ void prep_fold(unsigned sK, unsigned sX, unsigned sP, float* stage, const float* gam,
                                          const float* eg, int LK, int LX, const float* __restrict__ q, int t0,
                                          int n, int hk, int kh, int hv, int h, int dk, int dv, long long base,
                                          float* __restrict__ out, float* __restrict__ Nw, half_t* __restrict__ Mw,
                                          half_t* __restrict__ Qw) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, rr = lane >> 1, c0 = (lane & 1) * 8;
    const int NCb = (WPART ? dk : dv) / 16, NI = (NCb + 3) / 4, NK = dk / 16;
    const float gm1 = expm1f(gam[GC - 1]);
    for (int it = warp; it < (4 + NK) * NI; it += GTH / 32) {
        const bool top = it < 4 * NI;
        const int rb = top ? it / NI : (it - 4 * NI) / NI, cb0 = 4 * (it % NI);
        const int nk = top ? rb + 1 : GC / 16;
        FragC acc[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) frag_zero(acc[j]);
        for (int kk = 0; kk < nk; ++kk) {
            FragA ah, al;
            if (top) {
                lda_row(ah, sP + 2 * (rb * 16 * LP + kk * 16), LP);
                lda_row(al, sP + 2 * (GC * LP + rb * 16 * LP + kk * 16), LP);
            } else {
                lda_col(ah, sK + 2 * (kk * 16 * LK + rb * 16), LK);
                lda_col(al, sK + 2 * (GC * LK + kk * 16 * LK + rb * 16), LK);
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (cb0 + j < NCb) {
                    FragB bh, bl;
                    ldb_row(bh, sX + 2 * (kk * 16 * LX + (cb0 + j) * 16), LX);
                    ldb_row(bl, sX + 2 * (GC * LX + kk * 16 * LX + (cb0 + j) * 16), LX);
                    if (top) mma3<RR>(acc[j], ah, al, bh, bl);
                    else mma3<CR>(acc[j], ah, al, bh, bl);
                }
            }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (cb0 + j >= NCb) continue;
            const int col = (cb0 + j) * 16;
            if (!WPART && !top) {   // N tile (rb, cb0 + j)
                frag_raw_store(Nw + (base * (dk / 16) * (dv / 16) + rb * (dv / 16) + cb0 + j) * 256, acc[j]);
                continue;
            }
            float x[8];
            tile_to_lane(stage, acc[j], x);
            const int r = rb * 16 + rr;
            if (!WPART) {           // O' (top)
                if (r < n) {
                    float4* o = (float4*)(out + ((long long)(t0 + r) * hv + h) * dv + col + c0);
                    o[0] = make_float4(x[0], x[1], x[2], x[3]);
                    o[1] = make_float4(x[4], x[5], x[6], x[7]);
                }
            } else if (top) {       // Q' = q * exp(gamma) - QKD W (rows >= n: 0)
                const float4* qr = (const float4*)(q + ((long long)(t0 + r) * hk + kh) * dk + col + c0);
                const float4 a = r < n ? qr[0] : make_float4(0.f, 0.f, 0.f, 0.f);
                const float4 b = r < n ? qr[1] : make_float4(0.f, 0.f, 0.f, 0.f);
                const float e = eg[r], qv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
                for (int i = 0; i < 8; ++i) x[i] = qv[i] * e - x[i];
                half_t* dst = Qw + base * 2 * GC * dk + r * dk + col + c0;
                store8_hl(dst, dst + GC * dk, x);
            } else {                // M' = (Gn - 1) I - Kd^T W
#pragma unroll
                for (int i = 0; i < 8; ++i) x[i] = (r == col + c0 + i ? gm1 : 0.f) - x[i];
                half_t* dst = Mw + base * 2 * dk * dk + r * dk + col + c0;
                store8_hl(dst, dst + dk * dk, x);
            }
        }
    }
}

// chunks[c] = (start token, length, -, -). Workspace slot base = c * hv + h:
//   out rows of the chunk <- O';  Nw [base][dk/16][dv/16][256] fp32 (raw accumulator tiles);
//   Mw [base][hi/lo][dk][dk];  Qw [base][hi/lo][GC][dk] (first used as fp32 scratch for W, see below).
template <int DK, int DV>
__device__ __forceinline__ void gdn_prep_body(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v, long long vs,
    const float* __restrict__ g, const float* __restrict__ beta, const int4* __restrict__ chunks, int hk, int hv,
    int dk_, int dv_, float* __restrict__ out, float* __restrict__ Nw, half_t* __restrict__ Mw,
    half_t* __restrict__ Qw) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int dk = DK ? DK : dk_, dv = DV ? DV : dv_;
    const int LK = dk + 8, LX = max(dk, dv) + 8;
    const int oX = 4 * GC * LK, oP = oX + max(4 * GC * LX, 4 * GC * LA), oST = oP + 4 * GC * LP, oV = oST + 8192;
    half_t* Kh = (half_t*)smem;
    half_t* Kl = Kh + GC * LK;
    half_t* Xh = (half_t*)(smem + oX);
    half_t* Xl = Xh + GC * LX;
    half_t* Ph = (half_t*)(smem + oP);
    half_t* Pl = Ph + GC * LP;
    float* gam = (float*)(smem + oV);
    float* bet = gam + GC;
    float* eg = bet + GC;
    float* ed = eg + GC;
    const int c = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    float* stage = (float*)(smem + oST) + warp * 256;
    const unsigned sK = sa(smem), sX = sK + oX, sP = sK + oP;
    const int4 ch = chunks[c];
    const int t0 = ch.x, n = ch.y, kh = h / (hv / hk);
    const long long base = (long long)c * hv + h;

    if (tid < GC) {
        gam[tid] = tid < n ? g[(long long)(t0 + tid) * hv + h] : 0.f;
        bet[tid] = tid < n ? beta[(long long)(t0 + tid) * hv + h] : 0.f;
    }
    __syncthreads();
    if (tid == 0) {   // sequential fp32 cumsum, as numpy: gamma differences of long sums round the same way
        float acc = 0.f;  // (unrolled: the 64 shared loads are issued together, only the adds stay in order)
#pragma unroll
        for (int r = 0; r < GC; ++r) {
            acc += gam[r];
            gam[r] = acc;
        }
    }
#pragma unroll 4
    for (int e = tid; e < GC * dk / 4; e += GTH) {     // K, Q rows -> hi/lo (Q in RX with row stride LK)
        const int r = e / (dk / 4), d = (e % (dk / 4)) * 4;
        const long long off = ((long long)t0 * hk + kh) * dk + d;
        store4_hl(Kh + r * LK + d, Kl + r * LK + d, chunk_row4(k + off, r, n, hk * dk));
        store4_hl(Xh + r * LK + d, Xh + GC * LK + r * LK + d, chunk_row4(q + off, r, n, hk * dk));
    }
    __syncthreads();
    if (tid < GC) {
        eg[tid] = expf(gam[tid]);
        ed[tid] = expf(gam[GC - 1] - gam[tid]);
    }
    // K K^T and Q K^T on the 10 lower 16-blocks; one warp does both products of a block (shared B fragments)
    FragC akk[2], aqk[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int t = warp + 8 * i, ri = (t >= 1) + (t >= 3) + (t >= 6), ci = t - ri * (ri + 1) / 2;
        if (t >= 10) break;
        frag_zero(akk[i]);
        frag_zero(aqk[i]);
        for (int kk = 0; kk < dk / 16; ++kk) {
            FragA ah, al;
            FragB bh, bl;
            ldb_col(bh, sK + 2 * (ci * 16 * LK + kk * 16), LK);
            ldb_col(bl, sK + 2 * (GC * LK + ci * 16 * LK + kk * 16), LK);
            lda_row(ah, sK + 2 * (ri * 16 * LK + kk * 16), LK);
            lda_row(al, sK + 2 * (GC * LK + ri * 16 * LK + kk * 16), LK);
            mma3<RC>(akk[i], ah, al, bh, bl);
            lda_row(ah, sX + 2 * (ri * 16 * LK + kk * 16), LK);
            lda_row(al, sX + 2 * (GC * LK + ri * 16 * LK + kk * 16), LK);
            mma3<RC>(aqk[i], ah, al, bh, bl);
        }
    }
    __syncthreads();   // K, Q hi/lo dead: RX becomes A^T (RK becomes Kd after the solve)
    float* At = (float*)(smem + oX);
#pragma unroll
    for (int i = 0; i < 2; ++i) {   // epilogues read the staged tile element by element (rolled: compact code)
        const int t = warp + 8 * i, ri = (t >= 1) + (t >= 3) + (t >= 6), ci = t - ri * (ri + 1) / 2;
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
        stc_row(sa(stage), aqk[i], 16);
        __syncwarp();
#pragma unroll 1
        for (int e = 0; e < 8; ++e) {   // QKD = (q k^T) * D, lower
            const int s = s0 + e;
            const float y = s <= r ? sr[e] * expf(gam[r] - gam[s]) : 0.f;
            const half_t hh = f2h(y);
            Ph[r * LP + s] = hh;
            Pl[r * LP + s] = f2h(y - h2f(hh));
        }
        __syncwarp();
    }
    // (I + A) X = [beta V | beta Gamma K]: thread j owns column j of X in registers
    const bool isv = tid < dv, col = tid < dv + dk;
    float x[GC];
    {   // all 64 loads are issued before the first is used: rows past the chunk read its last row (n >= 1), then
        // zeroed; threads past dv + dk read column 0 (their x is never used). Loads guarded per row were a branch
        // each, and each waited for the previous one (a third of the kernel's stall samples at 2048 tokens).
        const float* p = (isv ? v + (long long)h * dv + tid : k + (long long)kh * dk + (col ? tid - dv : 0));
        const int st = isv ? (int)vs : hk * dk;   // a row stride: 32 bits (offsets within the chunk)
        p += (long long)t0 * st;
#pragma unroll
        for (int r = 0; r < GC; ++r) x[r] = p[min(r, n - 1) * st];
#pragma unroll
        for (int r = 0; r < GC; ++r) x[r] = r < n ? x[r] * (isv ? bet[r] : bet[r] * eg[r]) : 0.f;
    }
    __syncthreads();   // A^T complete
    const float4* At4 = (const float4*)(smem + oX);
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
    // W columns -> fp32 scratch in this slot's Qw (32 KB = GC * dk floats; Q' overwrites it after they are
    // read back), so that no thread holds registers through the U~ products
    float* wscr = (float*)(Qw + base * 2 * GC * dk);
    if (col && !isv) {
#pragma unroll
        for (int r = 0; r < GC; ++r) wscr[r * dk + tid - dv] = x[r];
    }
#pragma unroll 4
    for (int e = tid; e < GC * dk / 4; e += GTH) {
        const int r = e / (dk / 4), d = (e % (dk / 4)) * 4;
        float4 kv = chunk_row4(k + ((long long)t0 * hk + kh) * dk + d, r, n, hk * dk);
        const float f = ed[r];
        kv.x *= f; kv.y *= f; kv.z *= f; kv.w *= f;
        store4_hl(Kh + r * LK + d, Kl + r * LK + d, kv);
    }
    __syncthreads();   // A^T dead: RX takes U~, later W
    if (isv) {
#pragma unroll
        for (int r = 0; r < GC; ++r) {
            const half_t hh = f2h(x[r]);
            Xh[r * LX + tid] = hh;
            Xl[r * LX + tid] = f2h(x[r] - h2f(hh));
        }
    }
    __syncthreads();
    prep_fold<false>(sK, sX, sP, stage, gam, eg, LK, LX, q, t0, n, hk, kh, hv, h, dk, dv, base, out, Nw, Mw, Qw);
    __syncthreads();
#pragma unroll 4
    for (int e = tid; e < GC * dk / 4; e += GTH) {     // W (fp32 scratch) -> hi/lo
        const int r = e / (dk / 4), d = (e % (dk / 4)) * 4;
        store4_hl(Xh + r * LX + d, Xl + r * LX + d, *(const float4*)(wscr + r * dk + d));
    }
    __syncthreads();   // the scratch is read: Q' may overwrite it
    prep_fold<true>(sK, sX, sP, stage, gam, eg, LK, LX, q, t0, n, hk, kh, hv, h, dk, dv, base, out, Nw, Mw, Qw);
}

#define GDN_PREP_ARGS                                                                                           \
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v, long long vs,         \
        const float* __restrict__ g, const float* __restrict__ beta, const int4* __restrict__ chunks, int hk,    \
        int hv, int dk, int dv, float* __restrict__ out, float* __restrict__ Nw, half_t* __restrict__ Mw,        \
        half_t* __restrict__ Qw
extern "C" __global__ void __launch_bounds__(GTH, PREP_BLOCKS) gdn_prep(GDN_PREP_ARGS) {
    gdn_prep_body<0, 0>(q, k, v, vs, g, beta, chunks, hk, hv, dk, dv, out, Nw, Mw, Qw);
}
extern "C" __global__ void __launch_bounds__(GTH, PREP_BLOCKS) gdn_prep_d128(GDN_PREP_ARGS) {
    gdn_prep_body<128, 128>(q, k, v, vs, g, beta, chunks, hk, hv, dk, dv, out, Nw, Mw, Qw);
}

// ------------------------------------------------------------------------------------------------- gdn_scan
// seqs[b] = (first chunk, end chunk, zero_state, state slot); grid (hv, dv / BV, nseq), BV = 16 or 32.
// Warp w < dk/16 owns state rows [16w, 16w + 16) x BV columns: fp32 accumulators for the whole sequence.
// Per chunk: S += N (raw accumulator tiles, loaded a chunk ahead), S += M' S_hl with M' hi/lo and S hi/lo in
// shared memory; M' of the next chunk travels through registers (coalesced 16-byte loads issued a chunk ahead).
// The state entering each chunk also goes to Hw (hi/lo) for gdn_out.
// Shared memory: M' hi/lo 4 * dk * (dk + 8) + S hi/lo 4 * dk * (BV + 8) + 8 KB staging = 96 KB at dk = 128, BV = 32.
template <int DK, int DV>
__device__ __forceinline__ void gdn_scan_body(
    const int4* __restrict__ seqs, int hv, int dk_, int dv_, int BV, const float* __restrict__ Nw,
    const half_t* __restrict__ Mw, float* __restrict__ state, half_t* __restrict__ Hw) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int dk = DK ? DK : dk_, dv = DV ? DV : dv_;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, rr = lane >> 1, c0 = (lane & 1) * 8;
    const int LM = dk + 8, LS = BV + 8, NK = dk / 16, NB = BV / 16;
    half_t* Ms = (half_t*)smem;                               // [hi, lo][dk][LM]
    half_t* Sh = Ms + 2 * dk * LM;                            // [hi, lo][dk][LS]
    float* stage = (float*)(Sh + 2 * dk * LS) + warp * 256;
    const unsigned sM = sa(smem), sS = sM + 4 * dk * LM;
    const int h = blockIdx.x, j0 = blockIdx.y * BV;
    const int4 sq = seqs[blockIdx.z];
    float* gst = state + ((long long)sq.w * hv + h) * dk * dv + j0;
    const bool own = warp < NK;
    const int nm = 2 * dk * dk / 8;                           // uint4 of M' hi/lo per chunk
    uint4 pf[16];                                             // M' of the next chunk (<= 16 per thread)
    auto fetch = [&](int cc) {
        const uint4* m = (const uint4*)(Mw + ((long long)cc * hv + h) * 2 * dk * dk);
#pragma unroll
        for (int i = 0; i < 16; ++i)
            if (tid + i * GTH < nm) pf[i] = m[tid + i * GTH];
    };
    auto put = [&]() {   // pf -> Ms
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const int e = tid + i * GTH;
            if (e < nm) *(uint4*)(Ms + (e / (dk / 8)) * LM + (e % (dk / 8)) * 8) = pf[i];
        }
    };
    auto put_state = [&](const FragC (&S)[2], int cc) {   // S hi/lo -> Sh (and Hw[cc] while cc < end)
        half_t* sh = Sh + (warp * 16 + rr) * LS + c0;
        half_t* gh = Hw + ((long long)cc * hv + h) * 2 * dk * dv + (warp * 16 + rr) * dv + j0 + c0;
#pragma unroll
        for (int cb = 0; cb < 2; ++cb) {
            if (cb >= NB) break;
            float x[8];
            tile_to_lane(stage, S[cb], x);
            store8_hl(sh + cb * 16, sh + dk * LS + cb * 16, x);
            if (cc < sq.y) store8_hl(gh + cb * 16, gh + dk * dv + cb * 16, x);
        }
    };
    const float* nbase = Nw + (long long)h * NK * (dv / 16) * 256;
    const long long nstride = (long long)hv * NK * (dv / 16) * 256;   // one chunk of Nw
    const int ntile = warp * (dv / 16) + j0 / 16;

    FragC S[2], N[2];
    fetch(sq.x);
    if (own) {
#pragma unroll
        for (int cb = 0; cb < 2; ++cb) {
            if (cb >= NB) break;
            if (sq.z) frag_zero(S[cb]);
            else load_c_row(S[cb], gst + warp * 16 * dv + cb * 16, dv);
            frag_raw_load(N[cb], nbase + sq.x * nstride + (ntile + cb) * 256);
        }
        put_state(S, sq.x);
    }
    put();
    if (sq.x + 1 < sq.y) fetch(sq.x + 1);
    __syncthreads();
    for (int c = sq.x; c < sq.y; ++c) {
        if (own) {
#pragma unroll
            for (int cb = 0; cb < 2; ++cb) {
                if (cb >= NB) break;
#pragma unroll
                for (int e = 0; e < 8; ++e) S[cb].x[e] += N[cb].x[e];
                if (c + 1 < sq.y) frag_raw_load(N[cb], nbase + (c + 1) * nstride + (ntile + cb) * 256);
            }
            for (int kk = 0; kk < NK; ++kk) {
                FragA ah, al;
                lda_row(ah, sM + 2 * (warp * 16 * LM + kk * 16), LM);
                lda_row(al, sM + 2 * ((dk + warp * 16) * LM + kk * 16), LM);
#pragma unroll
                for (int cb = 0; cb < 2; ++cb) {
                    if (cb >= NB) break;
                    FragB bh, bl;
                    ldb_row(bh, sS + 2 * (kk * 16 * LS + cb * 16), LS);
                    ldb_row(bl, sS + 2 * ((dk + kk * 16) * LS + cb * 16), LS);
                    mma3<RR>(S[cb], ah, al, bh, bl);
                }
            }
        }
        __syncthreads();   // M' and S of chunk c consumed
        if (c + 1 < sq.y) {
            put();
            if (c + 2 < sq.y) fetch(c + 2);
        }
        if (own) put_state(S, c + 1);
        __syncthreads();
    }
    if (own) {
#pragma unroll
        for (int cb = 0; cb < 2; ++cb)
            if (cb < NB) store_c_row(gst + warp * 16 * dv + cb * 16, S[cb], dv);
    }
}

#define GDN_SCAN_ARGS                                                                                           \
    const int4* __restrict__ seqs, int hv, int dk, int dv, int BV, const float* __restrict__ Nw,                \
        const half_t* __restrict__ Mw, float* __restrict__ state, half_t* __restrict__ Hw
extern "C" __global__ void __launch_bounds__(GTH, 1) gdn_scan(GDN_SCAN_ARGS) {
    gdn_scan_body<0, 0>(seqs, hv, dk, dv, BV, Nw, Mw, state, Hw);
}
extern "C" __global__ void __launch_bounds__(GTH, 1) gdn_scan_d128(GDN_SCAN_ARGS) {
    gdn_scan_body<128, 128>(seqs, hv, dk, dv, BV, Nw, Mw, state, Hw);
}

// -------------------------------------------------------------------------------------------------- gdn_out
// out rows (< n) of chunk c += Q'_c S_c; grid (chunks, hv, ceil(dv / 64)). Q' hi/lo [GC][dk] and the block's 64
// columns of S_c hi/lo [dk][64] are staged in shared memory; warp w computes row block w & 3 x two column tiles.
// Shared memory: 4 * GC * (dk + 8) + 4 * dk * 72 halves + 8 KB staging (80 KB at dk = 128).
template <int DK, int DV>
__device__ __forceinline__ void gdn_out_body(
    const int4* __restrict__ chunks, int hv, int dk_, int dv_, const half_t* __restrict__ Qw,
    const half_t* __restrict__ Hw, float* __restrict__ out) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int dk = DK ? DK : dk_, dv = DV ? DV : dv_;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int LQ = dk + 8, LH = 72, c = blockIdx.x, h = blockIdx.y, j0 = blockIdx.z * 64;
    const int ncol = min(64, dv - j0);
    half_t* Qs = (half_t*)smem;                        // [hi, lo][GC][LQ]
    half_t* Hs = Qs + 2 * GC * LQ;                     // [hi, lo][dk][LH]
    float* stage = (float*)(Hs + 2 * dk * LH) + warp * 256;
    const unsigned sQ = sa(smem), sH = sQ + 4 * GC * LQ;
    const long long base = (long long)c * hv + h;
    const half_t* q = Qw + base * 2 * GC * dk;
    const half_t* s = Hw + base * 2 * dk * dv + j0;
#pragma unroll 4
    for (int e = tid; e < 2 * GC * dk / 8; e += GTH) {   // 8 halves per uint4
        const int r = e / (dk / 8), d = (e % (dk / 8)) * 8;
        *(uint4*)(Qs + r * LQ + d) = *(const uint4*)(q + r * dk + d);
    }
#pragma unroll 4
    for (int e = tid; e < 2 * dk * ncol / 8; e += GTH) {
        const int r = e / (ncol / 8), j = (e % (ncol / 8)) * 8;
        *(uint4*)(Hs + r * LH + j) = *(const uint4*)(s + (long long)(r / dk) * dk * dv + (r % dk) * dv + j);
    }
    __syncthreads();
    const int4 ch = chunks[c];
    const int rb = warp & 3, cb0 = (warp >> 2) * 2;
    FragC acc[2];
    frag_zero(acc[0]);
    frag_zero(acc[1]);
    for (int kk = 0; kk < dk / 16; ++kk) {
        FragA ah, al;
        lda_row(ah, sQ + 2 * (rb * 16 * LQ + kk * 16), LQ);
        lda_row(al, sQ + 2 * (GC * LQ + rb * 16 * LQ + kk * 16), LQ);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            if ((cb0 + j) * 16 < ncol) {
                FragB bh, bl;
                ldb_row(bh, sH + 2 * (kk * 16 * LH + (cb0 + j) * 16), LH);
                ldb_row(bl, sH + 2 * (dk * LH + kk * 16 * LH + (cb0 + j) * 16), LH);
                mma3<RR>(acc[j], ah, al, bh, bl);
            }
        }
    }
    const int r = rb * 16 + (lane >> 1), c0 = (lane & 1) * 8;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        if ((cb0 + j) * 16 >= ncol) continue;
        float x[8];
        tile_to_lane(stage, acc[j], x);
        if (r < ch.y) {
            float4* o = (float4*)(out + ((long long)(ch.x + r) * hv + h) * dv + j0 + (cb0 + j) * 16 + c0);
            const float4 a = o[0], b = o[1];
            o[0] = make_float4(a.x + x[0], a.y + x[1], a.z + x[2], a.w + x[3]);
            o[1] = make_float4(b.x + x[4], b.y + x[5], b.z + x[6], b.w + x[7]);
        }
    }
}
#define GDN_OUT_ARGS                                                                                            \
    const int4* __restrict__ chunks, int hv, int dk, int dv, const half_t* __restrict__ Qw,                     \
        const half_t* __restrict__ Hw, float* __restrict__ out
extern "C" __global__ void __launch_bounds__(GTH) gdn_out(GDN_OUT_ARGS) {
    gdn_out_body<0, 0>(chunks, hv, dk, dv, Qw, Hw, out);
}
extern "C" __global__ void __launch_bounds__(GTH) gdn_out_d128(GDN_OUT_ARGS) {
    gdn_out_body<128, 128>(chunks, hv, dk, dv, Qw, Hw, out);
}
