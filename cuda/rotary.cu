// Partial rotary position embedding (NeoX half split) of the first 2*half dims of each head.
//
// numpy twin: clefcore/backends/cpu.py::rotary (tables from clefcore/backends/cpu.py::rope_tables, built on
// the host in fp32 exactly as the reference does and copied once per forward).
// One thread per output element; x [T, H, D] rows may be strided (row stride xs between (t, h) rows).
// Memory-bound: one read and one write of x.
extern "C" __global__ void rotary_rows(const float* __restrict__ x, long long xs, const float* __restrict__ cs,
                                       const float* __restrict__ sn, float* __restrict__ y, int T, int H, int D,
                                       int half) {
    const long long n = (long long)T * H * D;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x) {
        const int i = (int)(e % D);
        const long long row = e / D;
        const int t = (int)(row / H);
        const float* xr = x + row * xs;
        float v;
        if (i < half) {
            const float c = cs[(long long)t * half + i], s = sn[(long long)t * half + i];
            v = xr[i] * c - xr[i + half] * s;
        } else if (i < 2 * half) {
            const int j = i - half;
            const float c = cs[(long long)t * half + j], s = sn[(long long)t * half + j];
            v = xr[i] * c + xr[j] * s;
        } else {
            v = xr[i];
        }
        y[e] = v;
    }
}
