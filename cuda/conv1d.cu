// Causal depthwise conv1d (cross-correlation, tap K-1 = current token) followed by SiLU.
//
// numpy twin: clefcore/backends/cpu.py::conv1d_silu.
// x [T, C] (row stride xs), w [C, K] fp32 (K <= CONV_KMAX), seq_start[t] = first token of t's packed sequence,
// so the receptive field never crosses a sequence boundary (the state resets there).
// A thread owns one channel over CONV_TT consecutive tokens and slides a window of the last K inputs in
// registers: each input is read once (consecutive threads take consecutive channels: coalesced rows), where
// one thread per (t, c) read every input K times. Memory-bound: one read and one write of [T, C].
// The window is kept right-aligned in CONV_KMAX registers (fixed indices: no local memory); taps beyond K have
// weight 0 and come first, so the sum runs over the real taps in the reference's order.
// Token-blocked prefill: prev (NULL = none) holds the K-1 pre-conv rows [K-1, C] just before x's first row,
// read by the first sequence only (the one with seq_start 0, which continues from the previous block).
#define CONV_KMAX 8
#define CONV_TT 16

extern "C" __global__ void conv1d_silu_k(const float* __restrict__ x, long long xs, const float* __restrict__ w,
                                         const int* __restrict__ seq_start, const float* __restrict__ prev,
                                         float* __restrict__ y, int T, int C, int K) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int t0 = blockIdx.y * CONV_TT;
    if (c >= C || t0 >= T) return;
    float wr[CONV_KMAX], v[CONV_KMAX];   // v[CONV_KMAX - 1 - i] = input at (current token - i)
#pragma unroll
    for (int j = 0; j < CONV_KMAX; ++j) {
        const int tap = j - (CONV_KMAX - K);
        wr[j] = tap >= 0 ? w[(long long)c * K + tap] : 0.f;
    }
    const int s0 = seq_start[t0];
    v[0] = 0.f;
#pragma unroll
    for (int i = 1; i < CONV_KMAX; ++i) {    // the inputs before t0 (before the shift below)
        const int tt = t0 - i;
        float val = 0.f;
        if (i < K) {
            if (tt >= s0) val = x[(long long)tt * xs + c];
            else if (prev != nullptr && s0 == 0) val = prev[(long long)(K - 1 + tt) * C + c];
        }
        v[CONV_KMAX - i] = val;
    }
    const int t1 = min(t0 + CONV_TT, T);
    for (int t = t0; t < t1; ++t) {
        const bool fresh = t > t0 && seq_start[t] == t;   // a new sequence: nothing before t is visible
#pragma unroll
        for (int j = 0; j < CONV_KMAX - 1; ++j) v[j] = fresh ? 0.f : v[j + 1];
        v[CONV_KMAX - 1] = x[(long long)t * xs + c];
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < CONV_KMAX; ++j) acc += v[j] * wr[j];
        y[(long long)t * C + c] = acc / (1.f + expf(-acc));
    }
}
