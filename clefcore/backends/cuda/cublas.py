"""``cublasGemmEx`` (and the fp32 batched product CuPy's matmul makes) on the current stream, callable during a
CUDA graph capture.

CuPy's cuBLAS binding refuses every call while a stream captures (NotImplementedError), although cuBLAS itself
records its kernels into the graph. So the entry points the GEMM path needs are called through ctypes on the
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
# CuPy's matmul passes a float32 product's data type (CUDA_R_32F) as the compute type, which cuBLAS takes in the
# place of CUBLAS_COMPUTE_32F for older callers; the same value here asks cuBLAS for the same kernels
LEGACY_COMPUTE_R_32F = R_32F


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
    """The libcublas that CuPy's binding loaded, with the prototypes set; None when it cannot be found."""
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
            vp, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
            lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
            lib.cublasGemmEx.restype = i
            lib.cublasGemmStridedBatchedEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, ll, vp, i, i, ll, vp, vp,
                                                       i, i, ll, i, i, i]
            lib.cublasGemmStridedBatchedEx.restype = i
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


def gemm_batched_f32(handle: int, a_ptr: int, b_ptr: int, out_ptr: int, batch: int, n: int, k: int, m: int,
                     stream_ptr: int) -> None:
    """out[h] = a[h] @ b[h] for h < batch, all fp32 and C-contiguous: a [batch, n, k], b [batch, k, m], out
    [batch, n, m], on ``stream_ptr``: the cuBLAS call CuPy's matmul makes for these operands
    (cublasGemmStridedBatchedEx: out^T = b^T a^T column-major, fp32 data, CuPy's compute type, default algorithm),
    so the same kernels run and give the same bits, but callable during a capture."""
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    args = (OP_N, OP_N, m, n, k, ctypes.addressof(one), b_ptr, R_32F, m, k * m, a_ptr, R_32F, k, n * k,
            ctypes.addressof(zero), out_ptr, R_32F, m, n * m, batch, LEGACY_COMPUTE_R_32F, GEMM_DEFAULT)
    lib = _library()
    if lib is None:
        from cupy_backends.cuda.libs import cublas
        cublas.setStream(handle, stream_ptr)
        cublas.gemmStridedBatchedEx(handle, *args)
        return
    h = ctypes.c_void_p(handle)
    st = lib.cublasSetStream_v2(h, ctypes.c_void_p(stream_ptr))
    if st == 0:
        st = lib.cublasGemmStridedBatchedEx(h, *args)
    if st != 0:
        from ... import errors
        raise errors.DeviceError(f"cublasGemmStridedBatchedEx {batch}x{n}x{m}x{k} failed with cuBLAS status {st}")
