"""``cublasGemmEx`` on the current stream, callable during a CUDA graph capture.

CuPy's cuBLAS binding refuses every call while a stream captures (NotImplementedError), although cuBLAS itself
records its kernels into the graph. So the two entry points the GEMM path needs are called through ctypes on the
very library CuPy's binding loaded (found in /proc/self/maps, so no second copy and the same handle type). Where
that lookup fails (not Linux, an unusual install) the CuPy binding is used: everything works, only the capture of
a graph falls back to eager runs (graphs.py logs it).
"""

from __future__ import annotations

import ctypes
import logging
import re

log = logging.getLogger("clefcore.cuda")

OP_N, OP_T = 0, 1
R_16F, R_32F = 2, 0
COMPUTE_32F = 68
GEMM_DEFAULT = -1


_ONE, _ZERO = ctypes.c_float(1.0), ctypes.c_float(0.0)
_lib = None
_looked = False


def missing() -> str | None:
    """Why cuBLAS cannot be used in this process (CuPy's binding fails to load libcublas / libcublasLt), or None
    when it can. An image without the CUDA math libraries runs clefcore's own GEMM kernels instead."""
    try:
        from cupy_backends.cuda.libs import cublas  # noqa: F401
    except (ImportError, OSError) as e:
        return str(e) or type(e).__name__
    return None


def _library():
    """The libcublas that CuPy's binding loaded, with the two prototypes set; None when it cannot be found."""
    global _lib, _looked
    if not _looked:
        _looked = True
        from cupy_backends.cuda.libs import cublas  # noqa: F401  (loads libcublas into this process)
        try:
            with open("/proc/self/maps") as f:
                paths = [m.group(1) for m in (re.search(r"(/\S*/libcublas\.so[.\d]*)\s*$", line) for line in f) if m]
        except OSError:
            paths = []
        if paths:
            lib = ctypes.CDLL(paths[0])
            vp, i = ctypes.c_void_p, ctypes.c_int
            lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
            lib.cublasGemmEx.restype = i
            lib.cublasSetStream_v2.argtypes = [vp, vp]
            lib.cublasSetStream_v2.restype = i
            _lib = lib
        else:
            log.warning("libcublas not found among the loaded libraries: using CuPy's cuBLAS binding "
                        "(CUDA graphs will not capture GEMMs and fall back to eager runs)")
    return _lib


def gemm(handle: int, a_ptr: int, w_ptr: int, out_ptr: int, M: int, N: int, K: int, stream_ptr: int,
         accumulate: bool = False) -> None:
    """out[M, N] fp32 (+)= a[M, K] fp16 @ w[N, K]^T fp16 with fp32 compute, on ``stream_ptr`` (row-major arrays,
    so cuBLAS computes out^T = w a^T)."""
    beta = _ONE if accumulate else _ZERO
    lib = _library()
    if lib is None:
        from cupy_backends.cuda.libs import cublas
        cublas.setStream(handle, stream_ptr)
        cublas.gemmEx(handle, OP_T, OP_N, N, M, K, ctypes.addressof(_ONE), w_ptr, R_16F, K, a_ptr, R_16F, K,
                      ctypes.addressof(beta), out_ptr, R_32F, N, COMPUTE_32F, GEMM_DEFAULT)
        return
    h = ctypes.c_void_p(handle)
    # the handle keeps the last stream set on it (CuPy sets it only in its own calls): set ours every time
    st = lib.cublasSetStream_v2(h, ctypes.c_void_p(stream_ptr))
    if st == 0:
        st = lib.cublasGemmEx(h, OP_T, OP_N, N, M, K, ctypes.byref(_ONE), w_ptr, R_16F, K, a_ptr, R_16F, K,
                              ctypes.byref(beta), out_ptr, R_32F, N, COMPUTE_32F, GEMM_DEFAULT)
    if st != 0:
        from ... import errors
        raise errors.DeviceError(f"cublasGemmEx {M}x{N}x{K} failed with cuBLAS status {st}")
