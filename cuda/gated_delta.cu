// Chunked (WY / UT) gated delta rule, chunk C = 64, fp32 state: the Gated DeltaNet core.
//
// numpy twin: clefcore/backends/cpu.py::gated_delta_rule (spec: qwen35-backbone.md §4).
//
// Two kernels over a list of 64-token chunks (each inside one packed sequence; the tail chunk is
// zero-padded, which is exact):
//  gdn_prep  (grid: chunk x value head, fully parallel): gamma = cumsum(g); A = beta k k^T * D (strictly
//            lower); solves (I + A) [U~ | W] = [beta V | beta Gamma K] by forward substitution, one column
//            per thread (no barrier inside the solve: a thread owns its column), and QKD = (q k^T) * D.
//            Only non-positive numbers are exponentiated (the mask is applied before exp).
//  gdn_scan  (grid: value head x dv-block x sequence): the only sequential part, one step per chunk:
//            U = U~ - W S; O = (q * Gamma) S + QKD U; S = Gamma_n S + (k * exp(gamma_n - gamma))^T U,
//            with the dk x BV state slice resident in shared memory for the whole sequence.
// All arithmetic fp32 (the state and the solve must be; the products are ~1% of the model's FLOPs).
#define GC 64

__device__ __forceinline__ int kv_head(int h, int hk, int hv) { return h / (hv / hk); }

// chunks[c] = (start token, length, unused, unused)
extern "C" __global__ void __launch_bounds__(256) gdn_prep(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v, long long vs,
    const float* __restrict__ g, const float* __restrict__ beta, const int4* __restrict__ chunks, int hk, int hv,
    int dk, int dv, float* __restrict__ Ut, float* __restrict__ Wt, float* __restrict__ QKD,
    float* __restrict__ gam) {
    extern __shared__ __align__(16) float sm[];
    const int W = dv + dk + 1;               // row stride of X = [V | K] (+1: conflict-free column walks)
    float* X = sm;                           // GC x W
    float* A = X + GC * W;                   // GC x (GC + 1)
    float* sG = A + GC * (GC + 1);           // GC
    float* sB = sG + GC;                     // GC
    const int c = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, nt = blockDim.x;
    const int4 ch = chunks[c];
    const int t0 = ch.x, n = ch.y, kh = kv_head(h, hk, hv);

    for (int r = tid; r < GC; r += nt) {
        sG[r] = r < n ? g[(long long)(t0 + r) * hv + h] : 0.f;
        sB[r] = r < n ? beta[(long long)(t0 + r) * hv + h] : 0.f;
    }
    for (int e = tid; e < GC * dv; e += nt) {
        const int r = e / dv, j = e % dv;
        X[r * W + j] = r < n ? v[(long long)(t0 + r) * vs + (long long)h * dv + j] : 0.f;
    }
    for (int e = tid; e < GC * dk; e += nt) {
        const int r = e / dk, j = e % dk;
        X[r * W + dv + j] = r < n ? k[((long long)(t0 + r) * hk + kh) * dk + j] : 0.f;
    }
    __syncthreads();
    if (tid == 0) {
        float acc = 0.f;
        for (int r = 0; r < GC; ++r) { acc += sG[r]; sG[r] = acc; }
    }
    __syncthreads();
    const long long base = (long long)c * hv + h;
    for (int e = tid; e < GC * GC; e += nt) {
        const int r = e / GC, s = e % GC;
        float a = 0.f, qk = 0.f;
        if (s <= r) {
            const float dec = expf(sG[r] - sG[s]);
            float kk = 0.f;
            const float* kr = X + r * W + dv;
            const float* ks = X + s * W + dv;
            if (s < r) {
                for (int d = 0; d < dk; ++d) kk += kr[d] * ks[d];
                a = sB[r] * kk * dec;
            }
            if (r < n) {
                const float* qr = q + ((long long)(t0 + r) * hk + kh) * dk;
                float acc = 0.f;
                for (int d = 0; d < dk; ++d) acc += qr[d] * ks[d];
                qk = acc * dec;
            }
        }
        A[r * (GC + 1) + s] = a;
        QKD[base * GC * GC + e] = qk;
    }
    __syncthreads();
    for (int e = tid; e < GC * (dv + dk); e += nt) {
        const int r = e / (dv + dk), j = e % (dv + dk);
        X[r * W + j] *= j < dv ? sB[r] : sB[r] * expf(sG[r]);
    }
    __syncthreads();
    for (int j = tid; j < dv + dk; j += nt) {      // forward substitution, column j
        for (int r = 1; r < GC; ++r) {
            float acc = X[r * W + j];
            const float* ar = A + r * (GC + 1);
            for (int s = 0; s < r; ++s) acc -= ar[s] * X[s * W + j];
            X[r * W + j] = acc;
        }
    }
    __syncthreads();
    for (int e = tid; e < GC * dv; e += nt) Ut[base * GC * dv + e] = X[(e / dv) * W + e % dv];
    for (int e = tid; e < GC * dk; e += nt) Wt[base * GC * dk + e] = X[(e / dk) * W + dv + e % dk];
    for (int r = tid; r < GC; r += nt) gam[base * GC + r] = sG[r];
}

// seqs[b] = (first chunk, end chunk, zero_state, state slot); grid (hv, dv / BV, nseq)
extern "C" __global__ void __launch_bounds__(256) gdn_scan(
    const float* __restrict__ q, const float* __restrict__ k, const int4* __restrict__ chunks,
    const int4* __restrict__ seqs, int hk, int hv, int dk, int dv, int BV, const float* __restrict__ Ut,
    const float* __restrict__ Wt, const float* __restrict__ QKD, const float* __restrict__ gam,
    float* __restrict__ state, float* __restrict__ out) {
    extern __shared__ __align__(16) float sm[];
    const int h = blockIdx.x, j0 = blockIdx.y * BV, tid = threadIdx.x, nt = blockDim.x;
    const int4 sq = seqs[blockIdx.z];
    const int kh = kv_head(h, hk, hv);
    float* S = sm;                          // dk x BV
    float* B1 = S + dk * BV;                // GC x (dk + 1)
    float* sU = B1 + GC * (dk + 1);         // GC x BV
    float* sQ = sU + GC * BV;               // GC x (GC + 1)
    float* sG = sQ + GC * (GC + 1);         // GC
    const int LB = dk + 1;
    float* gstate = state + ((long long)sq.w * hv + h) * dk * dv;
    for (int e = tid; e < dk * BV; e += nt) {
        const int d = e / BV, j = e % BV;
        S[e] = sq.z ? 0.f : gstate[(long long)d * dv + j0 + j];
    }
    for (int c = sq.x; c < sq.y; ++c) {
        const int4 ch = chunks[c];
        const int t0 = ch.x, n = ch.y;
        const long long base = (long long)c * hv + h;
        __syncthreads();
        for (int e = tid; e < GC * dk; e += nt) B1[(e / dk) * LB + e % dk] = Wt[base * GC * dk + e];
        for (int e = tid; e < GC * BV; e += nt) sU[e] = Ut[base * GC * dv + (e / BV) * dv + j0 + e % BV];
        for (int r = tid; r < GC; r += nt) sG[r] = gam[base * GC + r];
        __syncthreads();
        // U = U~ - W S   (one thread: fixed column, rows strided)
        for (int e = tid; e < GC * BV; e += nt) {
            const int r = e / BV, j = e % BV;
            float acc = sU[e];
            const float* wr = B1 + r * LB;
            for (int d = 0; d < dk; ++d) acc -= wr[d] * S[d * BV + j];
            sU[e] = acc;   // each element is read and written by the same thread only
        }
        __syncthreads();
        for (int e = tid; e < GC * dk; e += nt) {
            const int r = e / dk, d = e % dk;
            B1[r * LB + d] = r < n ? q[((long long)(t0 + r) * hk + kh) * dk + d] * expf(sG[r]) : 0.f;
        }
        for (int e = tid; e < GC * GC; e += nt) sQ[(e / GC) * (GC + 1) + e % GC] = QKD[base * GC * GC + e];
        __syncthreads();
        for (int e = tid; e < GC * BV; e += nt) {
            const int r = e / BV, j = e % BV;
            if (r >= n) continue;
            float acc = 0.f;
            const float* qr = B1 + r * LB;
            for (int d = 0; d < dk; ++d) acc += qr[d] * S[d * BV + j];
            const float* ar = sQ + r * (GC + 1);
            for (int s = 0; s <= r; ++s) acc += ar[s] * sU[s * BV + j];
            out[((long long)(t0 + r) * hv + h) * dv + j0 + j] = acc;
        }
        __syncthreads();
        const float gn = sG[GC - 1];
        for (int e = tid; e < GC * dk; e += nt) {
            const int r = e / dk, d = e % dk;
            B1[r * LB + d] = r < n ? k[((long long)(t0 + r) * hk + kh) * dk + d] * expf(gn - sG[r]) : 0.f;
        }
        __syncthreads();
        const float Gn = expf(gn);
        for (int e = tid; e < dk * BV; e += nt) {
            const int d = e / BV, j = e % BV;
            float acc = Gn * S[e];
            for (int r = 0; r < GC; ++r) acc += B1[r * LB + d] * sU[r * BV + j];
            S[e] = acc;
        }
    }
    __syncthreads();
    for (int e = tid; e < dk * BV; e += nt) {
        const int d = e / BV, j = e % BV;
        gstate[(long long)d * dv + j0 + j] = S[e];
    }
}
