"""Makes cuBLAS unloadable in this interpreter and every child that inherits PYTHONPATH=tests/no_cublas: importing
CuPy's cuBLAS binding fails as it does where libcublas is absent (an image without the CUDA math libraries), so the
GPU suite can run the engine on its own GEMM kernels on a machine that has cuBLAS. Nothing else is changed."""

import importlib.abc
import sys

_REFUSED = ("cupy_backends.cuda.libs.cublas", "cupy_backends.cuda.libs.cublasLt", "cupy.cublas")


class _NoCublas(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in _REFUSED:
            raise ImportError(f"{name}: cuBLAS made unloadable for this run (tests/no_cublas)")
        return None


sys.meta_path.insert(0, _NoCublas())
