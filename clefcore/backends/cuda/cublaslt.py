"""The fp8 GEMM of the split8 path through cuBLASLt (ctypes): out[M, N] fp32 = (a8[M, K] * sa) @ (w8[N, K] * sw)^T
with e4m3 operands, fp32 accumulation and per-tensor scales read from device memory.

CuPy exposes no cuBLASLt binding, and cublasGemmEx takes no fp8. The library is the one libcublas depends on, so
it is already in the process once CuPy's cuBLAS is loaded; it is found in /proc/self/maps (as cublas.py finds
libcublas) or by its soname. fp8 tensor cores need compute capability 8.9 or newer; ``available()`` says
whether this process can run the path at all (the caller also checks the device).
"""

from __future__ import annotations

import ctypes
import logging
import re

from ... import errors

log = logging.getLogger("clefcore.cuda")

_R_32F, _R_8F_E4M3 = 0, 28
_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
_TRANSA, _TRANSB, _A_SCALE, _B_SCALE, _FAST_ACCUM = 3, 4, 17, 18, 25   # cublasLtMatmulDescAttributes_t
_PREF_MAX_WORKSPACE = 1                                   # cublasLtMatmulPreferenceAttributes_t
WORKSPACE_BYTES = 32 << 20


class _Heuristic(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t (the same 96 bytes in the CUDA 12 and 13.10 headers): the algorithm (64
    opaque bytes), its workspace need and status."""
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


_lib = None
_looked = False


def _library():
    global _lib, _looked
    if _looked:
        return _lib
    _looked = True
    from cupy_backends.cuda.libs import cublas  # noqa: F401  (loads libcublas and, with it, libcublasLt)
    names = []
    try:
        with open("/proc/self/maps") as f:
            names = [m.group(1) for m in (re.search(r"(/\S*/libcublasLt\.so[.\d]*)\s*$", line) for line in f) if m]
    except OSError:
        pass
    for name in names[:1] + ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        return None
    vp, i, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
    for fn, args in (("cublasLtCreate", [ctypes.POINTER(vp)]),
                     ("cublasLtMatmulDescCreate", [ctypes.POINTER(vp), i, i]),
                     ("cublasLtMatmulDescSetAttribute", [vp, i, vp, sz]),
                     ("cublasLtMatrixLayoutCreate", [ctypes.POINTER(vp), i, u64, u64, i64]),
                     ("cublasLtMatmulPreferenceCreate", [ctypes.POINTER(vp)]),
                     ("cublasLtMatmulPreferenceSetAttribute", [vp, i, vp, sz]),
                     ("cublasLtMatmulAlgoGetHeuristic", [vp, vp, vp, vp, vp, vp, vp, i, ctypes.POINTER(_Heuristic),
                                                         ctypes.POINTER(i)]),
                     ("cublasLtMatmul", [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp])):
        f = getattr(lib, fn)
        f.argtypes = args
        f.restype = i
    _lib = lib
    return lib


def available() -> bool:
    return _library() is not None


def _check(status: int, what: str) -> None:
    if status != 0:
        raise errors.DeviceError(f"cuBLASLt {what} failed with status {status}")


class Fp8Gemm:
    """One handle, one workspace and one operation descriptor per CudaOps; layouts and the chosen algorithm are
    cached per (M, N, K), so a call costs two attribute writes and the launch.

    Fast accumulation is on: the fp8 tensor cores accumulate without cuBLASLt's periodic promotion to fp32. split8
    runs only the lo term here, about 2^-11 of each product, so the coarser accumulation reaches the result scaled
    down by that much; the kernel tests' split8 bound and the golden fixtures check it."""

    def __init__(self, cp):
        lib = _library()
        if lib is None:
            raise errors.DeviceError("cuBLASLt is not loaded in this process: the split8 precision needs it")
        self.lib, self.cp = lib, cp
        self.handle = ctypes.c_void_p()
        _check(lib.cublasLtCreate(ctypes.byref(self.handle)), "create")
        self.workspace = cp.empty(WORKSPACE_BYTES, dtype=cp.uint8)
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F), "matmul descriptor")
        # row-major out = a w^T is column-major out^T = w^T(op T on w's K x N storage) a (K x M): the "TN" form
        # fp8 tensor cores require (both operands K-contiguous)
        for attr, v in ((_TRANSA, _OP_T), (_TRANSB, _OP_N)):
            c = ctypes.c_int32(v)
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(c), 4), "transpose attribute")
        fast = ctypes.c_int8(1)
        _check(lib.cublasLtMatmulDescSetAttribute(self.desc, _FAST_ACCUM, ctypes.byref(fast), 1), "fast accumulation")
        self.pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self.pref)), "preference")
        ws = ctypes.c_uint64(WORKSPACE_BYTES)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(self.pref, _PREF_MAX_WORKSPACE, ctypes.byref(ws), 8),
               "workspace preference")
        self._plans: dict[tuple[int, int, int], tuple | None] = {}
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def supports(self, M: int, N: int, K: int) -> bool:
        """Whether cuBLASLt offers an fp8 algorithm for this shape (asked once per shape; the caller runs the
        split path where it does not)."""
        key = (M, N, K)
        if key not in self._plans:
            lib = self.lib
            lay = []
            for dtype, rows, cols, ld in ((_R_8F_E4M3, K, N, K), (_R_8F_E4M3, K, M, K), (_R_32F, N, M, N)):
                d = ctypes.c_void_p()
                _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(d), dtype, rows, cols, ld), "layout")
                lay.append(d)
            heur, n = _Heuristic(), ctypes.c_int(0)
            st = lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, lay[0], lay[1], lay[2], lay[2], self.pref,
                                                    1, ctypes.byref(heur), ctypes.byref(n))
            self._plans[key] = (lay, heur) if st == 0 and n.value >= 1 else None
            if self._plans[key] is None:
                log.info("cuBLASLt offers no fp8 algorithm for %dx%dx%d (status %d): that shape runs split", M, N,
                         K, st)
        return self._plans[key] is not None

    def __call__(self, a8, a_inv, w8, w_inv, out, stream_ptr: int) -> None:
        """out = (a8 * a_inv[0]) @ (w8 * w_inv[0])^T: a8 [M, K] / w8 [N, K] uint8 e4m3 bits, a_inv / w_inv fp32
        device scalars, out [M, N] fp32 (overwritten)."""
        M, K = a8.shape
        N = w8.shape[0]
        if not self.supports(M, N, K):
            raise errors.DeviceError(f"cuBLASLt has no fp8 algorithm for {M}x{N}x{K}")
        (la, lb, lc), heur = self._plans[(M, N, K)]
        lib = self.lib
        for attr, arr in ((_A_SCALE, w_inv), (_B_SCALE, a_inv)):
            p = ctypes.c_void_p(arr.data.ptr)
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(p), 8), "scale attribute")
        _check(lib.cublasLtMatmul(self.handle, self.desc, ctypes.byref(self._one), w8.data.ptr, la, a8.data.ptr, lb,
                                  ctypes.byref(self._zero), out.data.ptr, lc, out.data.ptr, lc,
                                  ctypes.addressof(heur), self.workspace.data.ptr, WORKSPACE_BYTES, stream_ptr),
               f"fp8 matmul {M}x{N}x{K}")
