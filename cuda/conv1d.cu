// Causal depthwise conv1d (cross-correlation, tap K-1 = current token) followed by SiLU.
//
// numpy twin: clefcore/backends/cpu.py::conv1d_silu.
// x [T, C] (row stride xs), w [C, K] fp32, seq_start[t] = first token of t's packed sequence, so the
// receptive field never crosses a sequence boundary (the state resets there). One thread per (t, c):
// consecutive threads take consecutive channels, so every tap is a coalesced row read; the K-1 earlier
// rows are L1/L2 hits. Memory-bound: one read and one write of [T, C].
// Token-blocked prefill: prev (NULL = none) holds the K-1 pre-conv rows [K-1, C] just before x's first row,
// read by the first sequence only (the one with seq_start 0, which continues from the previous block).
extern "C" __global__ void conv1d_silu_k(const float* __restrict__ x, long long xs, const float* __restrict__ w,
                                         const int* __restrict__ seq_start, const float* __restrict__ prev,
                                         float* __restrict__ y, int T, int C, int K) {
    const long long n = (long long)T * C;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x) {
        const int c = (int)(e % C);
        const int t = (int)(e / C);
        const int s0 = seq_start[t];
        float acc = 0.f;
        for (int j = 0; j < K; ++j) {
            const int tt = t - (K - 1) + j;
            const float wj = w[(long long)c * K + j];
            if (tt >= s0) acc += x[(long long)tt * xs + c] * wj;
            else if (prev != nullptr && s0 == 0) acc += prev[(long long)(K - 1 + tt) * C + c] * wj;
        }
        y[e] = acc / (1.f + expf(-acc));
    }
}
