"""CuPy elementwise and reduction kernels of the CUDA backend (each names its numpy twin), and the launch
constants the op objects share."""

from __future__ import annotations

import numpy as np

ELEM_THREADS = 256
NULL = np.uint64(0)     # a NULL device pointer passed by value


_K = {}


def ek(name, *args):
    if name not in _K:
        import cupy
        _K[name] = cupy.ElementwiseKernel(*args, name=name)
    return _K[name]


def rowdot_k():
    if "clef_rowdot" not in _K:
        import cupy
        _K["clef_rowdot"] = cupy.ReductionKernel("float32 x, float32 w", "float32 y", "x * w", "a + b", "y = a",
                                                 "0", name="clef_rowdot")
    return _K["clef_rowdot"]


def sigmoid_k():
    return ek("clef_sigmoid", "float32 x", "float32 y", "y = 1.0f / (1.0f + expf(-x))")


def sigmoid_gate_k(half: bool = False):
    # numpy twin: clefcore/backends/cpu.py::sigmoid_gate. half: y is written as the o-projection's fp16 operand
    # (fused_elementwise): the same fp32 quotient from the same compiler and flags, then CuPy's float16
    # conversion (__float2half: to nearest even, as gemm.cu's to_half)
    return ek("clef_sigmoid_gate_half" if half else "clef_sigmoid_gate", "float32 o, float32 g",
              "float16 y" if half else "float32 y", "y = o / (1.0f + expf(-g))")


def gelu_k():
    # numpy twin: clefcore/backends/cpu.py::gelu (exact erf GELU; evaluated in double like the reference)
    return ek("clef_gelu", "float32 x", "float32 y",
              "double xd = (double)x; y = (float)(0.5 * xd * (1.0 + erf(xd * 0.7071067811865476)))")


def gdn_gates_k():
    # numpy twin: clefcore/backends/cpu.py::gdn_gates
    return ek("clef_gdn_gates", "float32 a, float32 b, float32 a_log, float32 dt_bias", "float32 g, float32 beta",
              "float z = a + dt_bias; float sp = z > 20.0f ? z : log1pf(expf(fminf(z, 20.0f)));"
              "g = -expf(a_log) * sp; beta = 1.0f / (1.0f + expf(-b));")


def segment_softmax_sum_k():
    # numpy twin: clefcore/backends/cpu.py::segment_softmax_sum (np.add.at adds in row order, as this loop does).
    # One output value (group q, column j) a thread: the group's rows [a, b) by binary search in the
    # non-decreasing owner, then their max, the sum of exp(score - max) and the weighted sum of the column, each
    # in row order; every operation rounded on its own (no fused multiply-add), as CuPy's separate kernels round.
    return ek("clef_segment_softmax_sum",
              "raw float32 scores, raw float32 values, raw int64 owner, int64 n, int64 width", "float32 y",
              "const long long q = i / width, j = i - q * width;"
              "long long lo = 0, hi = n;"
              "while (lo < hi) { long long mid = (lo + hi) >> 1; if (owner[mid] < q) lo = mid + 1; else hi = mid; }"
              "const long long a = lo;"
              "hi = n;"
              "while (lo < hi) { long long mid = (lo + hi) >> 1; if (owner[mid] <= q) lo = mid + 1; else hi = mid; }"
              "const long long b = lo;"
              "float m = -__int_as_float(0x7f800000);"
              "for (long long r = a; r < b; ++r) m = fmaxf(m, scores[r]);"
              "float den = 0.0f;"
              "for (long long r = a; r < b; ++r) den = __fadd_rn(den, expf(__fsub_rn(scores[r], m)));"
              "float acc = 0.0f;"
              "for (long long r = a; r < b; ++r) {"
              "  const float w = __fdiv_rn(expf(__fsub_rn(scores[r], m)), den);"
              "  acc = __fadd_rn(acc, __fmul_rn(w, values[r * width + j]));"
              "}"
              "y = acc;")
