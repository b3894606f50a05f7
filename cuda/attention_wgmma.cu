// Hopper causal GQA attention (sm_90a) with warpgroup MMAs: the causal prefill of clef-flash's full-attention
// layers (head dim 256), as attention.cu's attn_fwd_d256 computes it, with wgmma.mma_async in place of mma.sync.
// Routed by the attn_wgmma kernel switch on compute capability 9.0 with an fp16 K/V cache
// (clefcore/backends/cuda/attention.py::causal_kernels); attention.cu stays for every other case.
//
// numpy twin: clefcore/backends/cpu.py::attention (q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]).
//
// Same arguments, work list and roundings as attention.cu's attn_fwd_d{D}: fp16 q, K, V (the cache), scores in
// fp32 scaled by scale * log2(e) so that each probability is one exp2, the running max m, the running sum l
// (of the unrounded probabilities) and the rescale in fp32, P rounded to fp16 for P V, fp32 accumulation; tiles =
// (seq_start, seq_end, q0, q1) in absolute rows of the packed stream, q and out holding the rows [qbase, ...)
// (token-blocked prefill), seq_end clipped by the host to the block's end so that cache rows not yet written
// are never read (zero-filled instead). The block's tile is 128 query rows (attn_wgmma_launch_d256).
//
// A block = one query head h (blockIdx.x, heads fastest: the host's tiles are longest first) x 128 query rows,
// 256 threads = 2 warpgroups of 64 rows each; kv head = h / (Hq / Hkv). Per 64-key tile of its sequence, up to
// the block's last query:
//   S = Q K^T: 16 wgmma m64n64k16 (4 panels of 64 head columns x 4 k-steps of 16), Q and K both K-major in
//     shared memory (the layout and descriptor of gemm_wgmma.cu's operands, cuda/wgmma.cuh), 32 fp32 a thread.
//   online softmax in registers: the accumulator layout is mma.sync's m16n8 one repeated (warp w of the
//     warpgroup holds rows 16 w + lane / 4 and + 8, columns 8 j + 2 (lane % 4) and + 1), so a row's max and sum
//     are a quad shuffle, exactly as attention.cu's sm_80 body; only tiles reaching past the warpgroup's first
//     row are masked (the diagonal ones).
//   O += P V: P packed to fp16 straight from the score registers, which is wgmma's register-A fragment layout
//     (m64k16: the same per-warp layout as mma.sync's A), against V in shared memory through an MN-major
//     descriptor (imm-trans-b = 1): V's rows are keys (k) with the head dim (n) contiguous, stored in the same
//     swizzled 64-column panels as K, so no transposed copy is made. 4 wgmma m64n256k16 per tile, O = 128 fp32
//     a thread (64 rows x 256 columns per warpgroup).
// Overlap inside a warpgroup (FlashAttention-3's order): iteration j issues S(j), rescales O to tile j-1's max
// while S(j) runs, issues P V (j-1), waits for S(j) only, and runs tile j's softmax (in place, fp32) while
// P V (j-1) is still on the tensor cores; P(j) is packed into the fragments once P V (j-1), which reads them, is
// done. So P V lags S by one tile; the last tile's P V follows the loop. In flight across the softmax: O (128),
// the P fragments (16) and the scores (32) of a thread; a second set of P fragments does not fit beside them.
//
// Shared memory (1024-byte aligned; 197,632 bytes with the alignment slack): Q (4 panels x 128 rows x 128 bytes,
// 64 KiB), K x 2 buffers and V x 2 buffers (4 panels x 64 rows x 128 bytes each, 32 KiB). Copies by cp.async
// from all 256 threads (zero-filled past the sequence's end). Iteration j opens with the wait for P V (j-2),
// then this thread's copies, fence.proxy.async (cp.async writes through the generic proxy, wgmma reads through
// the async one) and a barrier; then K(j+1) is copied into the K buffer of tile j-1 (its S was waited for in
// iteration j-1) and V(j) into the V buffer of tile j-2 (its P V was waited for before this barrier), so the
// copies run under tile j's MMAs.
//
// Both warpgroups issue the same MMAs for every tile, even one past all of the first warpgroup's rows (the
// diagonal's last tile: wholly masked, P = 0) or a warpgroup whose rows all lie past q1 (zero queries, nothing
// written): ptxas serializes wgmmas on a path that may differ within a block, which costs more than that work.
//
// Built only for sm_90a (the feature macro __CUDA_ARCH_FEAT_SM90_ALL): other targets, compute_70 PTX and plain
// sm_90 included, compile to empty kernels, and the host never routes there.
#include "mma_sm70.cuh"
#include "attn_rows.cuh"
#include "wgmma.cuh"

// the one head dim (clef-flash's full attention): 4 panels of 64 columns; O's n256 wgmma covers it whole
#define WA_D 256
#define WA_NP (WA_D / 64)
#define WA_BM 128   // query rows per block: 2 warpgroups x 64
#define WA_BC 64    // keys per tile

struct WaSmem {
    static constexpr unsigned Q = WA_NP * WA_BM * 128;   // bytes
    static constexpr unsigned KV = WA_NP * WA_BC * 128;  // one K or V tile
    static constexpr unsigned total = Q + 4 * KV + 1024; // + slack to align the base to 1024 bytes
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)

// s (64 x 64, fp32, this thread's share) += A (64 x 16) @ B (64 x 16)^T, both K-major in shared memory
__device__ __forceinline__ void wa_mma_qk(float (&d)[32], unsigned long long da, unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {" WG_ACC32_NAMES "}, %32, %33, 1, 1, 1, 0, 0;\n"
                 : WG_ACC32(d)
                 : "l"(da), "l"(db));
}

// o (64 x 256, fp32) += P (64 x 16, fp16 A fragments in registers) @ V (16 keys x 256), V MN-major in shared memory
// (imm-trans-b = 1)
__device__ __forceinline__ void wa_mma_pv(float (&d)[128], const unsigned (&a)[4], unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {" WG_ACC128_NAMES
                 "}, {%128, %129, %130, %131}, %132, 1, 1, 1, 1;\n"
                 : WG_ACC128(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

__device__ __forceinline__ void wa_fence_frag(unsigned (&a)[4][4]) {   // as wg_fence_acc, for P's fragments
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[i][e])::"memory");
}

// R rows (head h's 256 columns) of x, row 0 at src, rows `stride` halves apart -> the 4 panels at dst (R rows of
// 128 bytes each, 128-byte swizzle), rows n.. zero-filled (nothing read). Thread t copies chunk t % 8 of rows
// t / 8 + 32 i in every panel: the same r % 8, so the same swizzled chunk, for every i (gemm_wgmma.cu's order).
template <int R>
__device__ __forceinline__ void wa_load(unsigned dst, const half_t* __restrict__ src, long long stride, int n) {
    const int c = threadIdx.x & 7, r0 = threadIdx.x >> 3;
    const unsigned sw = (unsigned)((c ^ (r0 & 7)) << 4);
#pragma unroll
    for (int i = 0; i < R / 32; ++i) {
        const int r = r0 + 32 * i;
        const bool ok = r < n;
        const half_t* s = src + (ok ? r * stride : 0) + c * 8;
#pragma unroll
        for (int p = 0; p < WA_NP; ++p) wg_cp16(dst + p * (R * 128) + r * 128 + sw, s + p * 64, ok);
    }
}

// Scores of key tile j0 (the accumulators s of S = Q K^T) -> in place, this tile's probabilities exp2(s scale2 -
// m) in fp32; the running max m and sum l of rows r and r + 8 updated; alpha = the factor that rescales O to the
// new max. Masks keys past the row (causal) only when the tile reaches past the warpgroup's first row w0.
__device__ __forceinline__ void wa_softmax(float (&s)[32], float (&m)[2], float (&l)[2], float (&alpha)[2], int j0,
                                           int w0, int r, int tq, float scale2) {
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] *= scale2;
    if (j0 + WA_BC - 1 > w0) {
        // key j0 + 2 tq + c (c = 8 c8 + (e & 1), a constant) is past row r + 8 hr when c > lim + 8 hr
        const int lim = r - j0 - 2 * tq;
#pragma unroll
        for (int c8 = 0; c8 < 8; ++c8)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (c8 * 8 + (e & 1) > lim + (e >> 1) * 8) s[4 * c8 + e] = -CLEF_INF;
    }
#pragma unroll
    for (int i = 0; i < 32; ++i) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);   // element 4 c8 + e: row e >> 1
    float muse[2];
    attn_new_max(mx, m, l, muse, alpha);
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        const float p = exp2f(s[i] - muse[(i >> 1) & 1]);   // masked: exp2(-inf) = 0
        l[(i >> 1) & 1] += p;
        s[i] = p;
    }
}

// the probabilities in s -> fp16 A fragments: 8-key column tiles 2 kk and 2 kk + 1 make fragment kk, whose
// registers are (row r, keys 0-7), (row r + 8, keys 0-7), (row r, keys 8-15), (row r + 8, keys 8-15)
__device__ __forceinline__ void wa_pack(unsigned (&pa)[4][4], const float (&s)[32]) {
#pragma unroll
    for (int c8 = 0; c8 < 8; ++c8) {
        pa[c8 >> 1][(c8 & 1) * 2] = pack2h(s[4 * c8], s[4 * c8 + 1]);
        pa[c8 >> 1][(c8 & 1) * 2 + 1] = pack2h(s[4 * c8 + 2], s[4 * c8 + 3]);
    }
}

// O (rows r, r + 8 of this thread's accumulators) *= alpha
__device__ __forceinline__ void wa_rescale(float (&o)[128], const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        o[4 * i] *= alpha[0]; o[4 * i + 1] *= alpha[0]; o[4 * i + 2] *= alpha[1]; o[4 * i + 3] *= alpha[1];
    }
}

// S = Q K^T for key tile buffer ak: 4 panels x 4 k-steps (32 bytes along the 128-byte rows), into zeroed s. The
// descriptors are made here from aq and ak, each step an add to the address field (as CUTLASS's descriptor
// iterator does: addresses stay below 256 KiB, so the 14-bit field never carries); aq goes through an opaque
// copy so that the compiler does not hoist the 16 loop-invariant Q descriptors into 32 registers.
__device__ __forceinline__ void wa_issue_qk(float (&s)[32], unsigned aq, unsigned ak) {
    asm volatile("mov.b32 %0, %0;" : "+r"(aq));
    const unsigned long long dq = wg_desc(aq), dk = wg_desc(ak);
#pragma unroll
    for (int p = 0; p < WA_NP; ++p)
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)
            wa_mma_qk(s, dq + ((p * (WA_BM * 128) + ks * 32) >> 4), dk + ((p * (WA_BC * 128) + ks * 32) >> 4));
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// O += P V for value tile buffer av: keys 16 kk.. are two 8-row atoms (2048 bytes) on; the 4 panels, 64 keys x
// 128 bytes apart, are the MN-major descriptor's leading offset
__device__ __forceinline__ void wa_issue_pv(float (&o)[128], const unsigned (&pa)[4][4], unsigned av) {
    const unsigned long long dv = wg_desc_mn(av, WA_BC * 128);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wa_mma_pv(o, pa[kk], dv + ((kk * 2048) >> 4));
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// wait for this thread's copies, make them visible to the async proxy, then for every thread's
__device__ __forceinline__ void wa_landed() {
    asm volatile("cp.async.wait_group 0;\n" ::);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
}

__device__ __forceinline__ void wa_body(const half_t* __restrict__ q, const half_t* __restrict__ k,
                                        const half_t* __restrict__ v, float* __restrict__ out,
                                        const int4* __restrict__ tiles, int Hq, int Hkv, float scale2, int qbase) {
    extern __shared__ unsigned char wa_buf[];
    const unsigned base = (wg_smem(wa_buf) + 1023u) & ~1023u;         // swizzle atoms are 1024-byte aligned
    const unsigned sQ = base, sK = base + WaSmem::Q, sV = sK + 2 * WaSmem::KV;
    const int4 tile = tiles[blockIdx.y];
    const int s0 = tile.x, s1 = tile.y, q0 = tile.z, q1 = tile.w;
    const int h = blockIdx.x, kh = h / (Hq / Hkv);
    const int t = threadIdx.x, wg = t >> 7, warp = (t >> 5) & 3, lane = t & 31, tq = lane & 3;
    const long long kvs = (long long)Hkv * WA_D;                      // halves between K (V) rows
    const int nt = (q1 - s0 + WA_BC - 1) / WA_BC;                     // key tiles up to the block's last query
    const int w0 = q0 + 64 * wg;                                      // the warpgroup's first row
    const int r = w0 + warp * 16 + (lane >> 2);                       // this thread's rows: r and r + 8
    const unsigned aq = sQ + wg * 64 * 128;                           // the warpgroup's 64 rows of each Q panel
    // K (V) tile j: rows s0 + 64 j.., into buffer j % 2; rows from s1 on zero-filled
    auto load_k = [&](int j) {
        wa_load<WA_BC>(sK + (j & 1) * WaSmem::KV, k + ((long long)(s0 + j * WA_BC) * Hkv + kh) * WA_D, kvs,
                       s1 - s0 - j * WA_BC);
    };
    auto load_v = [&](int j) {
        wa_load<WA_BC>(sV + (j & 1) * WaSmem::KV, v + ((long long)(s0 + j * WA_BC) * Hkv + kh) * WA_D, kvs,
                       s1 - s0 - j * WA_BC);
    };

    float o[128], s[32], alpha[2];
    unsigned pa[4][4];                            // P of the tile before, fp16 A fragments per 16 keys
    float m[2] = {-CLEF_INF, -CLEF_INF}, l[2] = {0.f, 0.f};   // rows r, r + 8 (l: this lane's columns)
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;

    // tile 0: S only
    wa_load<WA_BM>(sQ, q + ((long long)(q0 - qbase) * Hq + h) * WA_D, (long long)Hq * WA_D, q1 - q0);
    load_k(0);
    asm volatile("cp.async.commit_group;\n" ::);
    wa_landed();
    if (nt > 1) load_k(1);
    load_v(0);
    asm volatile("cp.async.commit_group;\n" ::);
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] = 0.f;
    wg_fence_acc(s);
    wg_fence_acc(o);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    wa_issue_qk(s, aq, sK);
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    wg_fence_acc(s);
    wa_softmax(s, m, l, alpha, s0, w0, r, tq, scale2);

    // The wait for P V (j-2) opens iteration j, a basic block of its own, rather than closing iteration j-1 right
    // after the softmax: ptxas's scheduler moves a wgmma wait to the top of the block it is in, ahead of the
    // softmax that should overlap it.
    for (int j = 1; j < nt; ++j) {
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");   // PV(j-2): o and pa are free
        wg_fence_acc(o);
        wa_fence_frag(pa);
        wa_pack(pa, s);                           // P(j-1)
        wa_fence_frag(pa);
        wa_landed();                              // K(j), V(j-1); S(j-1) and PV(j-2) done in every warpgroup
        if (j + 1 < nt) load_k(j + 1);            // into S(j-1)'s buffer
        load_v(j);                                // into PV(j-2)'s buffer
        asm volatile("cp.async.commit_group;\n" ::);
#pragma unroll
        for (int i = 0; i < 32; ++i) s[i] = 0.f;
        wg_fence_acc(s);                          // (the fences pin register writes before the wgmma fence)
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");   // after the writes of s and pa
        wa_issue_qk(s, aq, sK + (j & 1) * WaSmem::KV);
        wa_rescale(o, alpha);
        wg_fence_acc(o);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");   // after the writes of o
        wa_issue_pv(o, pa, sV + ((j - 1) & 1) * WaSmem::KV);
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");   // S(j); PV(j-1) may still run
        wg_fence_acc(s);
        wa_softmax(s, m, l, alpha, s0 + j * WA_BC, w0, r, tq, scale2);
    }
    // the last tile's P V
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    wg_fence_acc(o);
    wa_fence_frag(pa);
    wa_pack(pa, s);
    wa_fence_frag(pa);
    wa_landed();                                  // V(nt-1)
    wa_rescale(o, alpha);
    wg_fence_acc(o);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    wa_issue_pv(o, pa, sV + ((nt - 1) & 1) * WaSmem::KV);
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    wg_fence_acc(o);

    // accumulator 4 i + e: row r (+ 8 for e >= 2), column 8 i + 2 tq (+ 1 for odd e)
    attn_write_rows<WA_D>(out, l, o, r, q1, qbase, Hq, h, tq);
}
#endif

// The launch: grid (Hq, tiles), 256 threads, attn_wgmma_launch_d256's shared memory; tiles of 128 query rows.
extern "C" __global__ void __launch_bounds__(256, 1) attn_wgmma_fwd_d256(const half_t* q, const half_t* k,
                                                                        const half_t* v, float* out,
                                                                        const int4* tiles, int Hq, int Hkv,
                                                                        float scale, int qbase) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    wa_body(q, k, v, out, tiles, Hq, Hkv, scale * 1.4426950408889634f, qbase);
#endif
}

// attn_wgmma_launch_d256: n[0] = dynamic shared memory bytes, n[1] = warps per block (16 query rows per warp), as
// attention.cu's attn_launch_d{D}
extern "C" __global__ void attn_wgmma_launch_d256(int* n) {
    n[0] = WaSmem::total;
    n[1] = WA_BM / 16;
}
