"""Kernel sources in ``cuda/`` -> loaded modules.

Two paths:

* **run time** (:func:`load_module`): NVRTC through CuPy's ``RawModule`` compiles a ``.cu`` file for the GPU
  that runs it (CuPy caches the binary on disk).
* **offline** (:class:`Nvrtc`, :func:`compile_file`): ``libnvrtc.so.12`` from the pip wheel
  ``nvidia-cuda-nvrtc-cu12`` through ctypes, with no GPU and no CUDA toolkit: PTX for ``compute_70`` and cubins
  for ``sm_70`` / ``sm_90`` with the ptxas report (registers, spills, stack). CI uses it to prove every kernel
  builds for Volta; on a newer GPU whose CuPy (CUDA 13) can no longer target sm_70, the compute_70 PTX made
  here is loaded with ``RawModule(path=...)`` so that the Volta code itself runs (``CudaOps(ptx70=True)``).

Sources are self-contained: ``#include "x.cuh"`` lines are inlined from the same folder, so neither path
needs an include directory or a ``-D``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)


def kernel_dir() -> Path:
    """The installed ``clefcore/cuda`` package data (meson installs ``cuda/`` there), else the repository's
    ``cuda/`` folder when running in-tree. Located by path: ``clefcore.cuda`` has no ``__init__`` and a
    top-level ``cuda`` package from NVIDIA's wheels may shadow a namespace lookup."""
    installed = Path(__file__).resolve().parents[2] / "cuda"
    if any(installed.glob("*.cu")):
        return installed
    return Path(__file__).resolve().parents[3] / "cuda"


def kernel_files() -> list[Path]:
    return sorted(kernel_dir().glob("*.cu"))


def source(name: str) -> str:
    """The text of ``cuda/<name>`` with local includes inlined once each (``#pragma once`` semantics)."""
    d = kernel_dir()
    seen: set[str] = set()

    def expand(fname: str) -> str:
        if fname in seen:
            return ""
        seen.add(fname)
        text = (d / fname).read_text()

        def sub(m):
            return f"// ---- {m.group(1)} ----\n" + expand(m.group(1)) + f"\n// ---- end {m.group(1)} ----\n"

        return _INCLUDE.sub(sub, text.replace("#pragma once", ""))

    return expand(name)


# ------------------------------------------------------------------------------------------- offline NVRTC

def _nvrtc_candidates() -> list[str]:
    out = []
    if os.environ.get("CLEFCORE_NVRTC"):
        out.append(os.environ["CLEFCORE_NVRTC"])
    try:
        import nvidia.cuda_nvrtc as m   # pip nvidia-cuda-nvrtc-cu12
        for base in list(getattr(m, "__path__", [])):
            out += sorted(str(p) for p in Path(base, "lib").glob("libnvrtc.so.12*"))
    except ImportError:
        pass
    out.append("libnvrtc.so.12")
    return out


class NvrtcError(RuntimeError):
    pass


@dataclass
class Compiled:
    name: str
    target: str
    image: bytes       # PTX text (compute_XX) or cubin (sm_XX)
    log: str


class Nvrtc:
    """ctypes binding of the handful of NVRTC calls the offline path needs."""

    def __init__(self, path: str | None = None):
        errs = []
        for cand in ([path] if path else _nvrtc_candidates()):
            try:
                self.lib = ctypes.CDLL(cand)
                self.path = cand
                break
            except OSError as e:
                errs.append(f"{cand}: {e}")
        else:
            raise NvrtcError("libnvrtc.so.12 not found (pip install nvidia-cuda-nvrtc-cu12): " + "; ".join(errs))
        L = self.lib
        L.nvrtcGetErrorString.restype = ctypes.c_char_p
        major, minor = ctypes.c_int(), ctypes.c_int()
        L.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        self.version = (major.value, minor.value)

    def _check(self, rc, what):
        if rc != 0:
            raise NvrtcError(f"{what}: {self.lib.nvrtcGetErrorString(rc).decode()}")

    def compile(self, src: str, name: str, target: str, extra: tuple[str, ...] = ()) -> Compiled:
        """target 'compute_70' -> PTX; 'sm_70' / 'sm_90' -> cubin with the ptxas report in the log."""
        L = self.lib
        prog = ctypes.c_void_p()
        self._check(L.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None), "create")
        opts = [f"--gpu-architecture={target}", "-std=c++17", "-lineinfo"]
        if target.startswith("sm_"):
            opts.append("--ptxas-options=-v")
        opts += list(extra)
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        try:
            rc = L.nvrtcCompileProgram(prog, len(opts), arr)
            n = ctypes.c_size_t()
            L.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
            buf = ctypes.create_string_buffer(n.value)
            L.nvrtcGetProgramLog(prog, buf)
            log = buf.value.decode(errors="replace")
            if rc != 0:
                raise NvrtcError(f"{name} for {target} failed:\n{log}")
            if target.startswith("sm_"):
                self._check(L.nvrtcGetCUBINSize(prog, ctypes.byref(n)), "cubin size")
                img = ctypes.create_string_buffer(n.value)
                self._check(L.nvrtcGetCUBIN(prog, img), "cubin")
            else:
                self._check(L.nvrtcGetPTXSize(prog, ctypes.byref(n)), "ptx size")
                img = ctypes.create_string_buffer(n.value)
                self._check(L.nvrtcGetPTX(prog, img), "ptx")
            return Compiled(name, target, img.raw[: n.value], log)
        finally:
            L.nvrtcDestroyProgram(ctypes.byref(prog))


_NVRTC: Nvrtc | None = None


def nvrtc() -> Nvrtc:
    global _NVRTC
    if _NVRTC is None:
        _NVRTC = Nvrtc()
    return _NVRTC


def compile_file(name: str, target: str) -> Compiled:
    return nvrtc().compile(source(name), name, target)


_PTXAS_FN = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def ptxas_report(log: str) -> dict[str, dict]:
    """{kernel: {'registers', 'stack', 'spill_stores', 'spill_loads'}} parsed from a ``-v`` log."""
    out: dict[str, dict] = {}
    cur = None
    for line in log.splitlines():
        m = _PTXAS_FN.search(line)
        if m:
            cur = out.setdefault(m.group(1), {"registers": 0, "stack": 0, "spill_stores": 0, "spill_loads": 0})
            continue
        if cur is None:
            continue
        m = _PTXAS_STACK.search(line)
        if m:
            cur["stack"], cur["spill_stores"], cur["spill_loads"] = map(int, m.groups())
        m = _PTXAS_REGS.search(line)
        if m:
            cur["registers"] = int(m.group(1))
    return out


def _ptx70_file(name: str, cache_dir=None) -> Path:
    key = hashlib.sha256(source(name).encode()).hexdigest()[:16]
    d = Path(cache_dir or os.environ.get("CLEFCORE_KERNEL_CACHE") or Path(tempfile.gettempdir()) / "clefcore-ptx")
    return d / f"{Path(name).stem}-{key}.ptx"


def ptx70_available() -> bool:
    """True when the compute_70 PTX of every kernel exists in the cache or the pip NVRTC 12 can make it."""
    if all(_ptx70_file(p.name).exists() for p in kernel_files()):
        return True
    try:
        nvrtc()
        return True
    except NvrtcError:
        return False


def ptx70_path(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """compute_70 PTX of ``cuda/<name>`` written to a cache file (keyed by the source and NVRTC version)."""
    p = _ptx70_file(name, cache_dir)
    if not p.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
        c = nvrtc().compile(source(name), name, "compute_70")
        tmp = p.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(c.image.rstrip(b"\0"))
        tmp.replace(p)
    return p


# ----------------------------------------------------------------------------------------------- run time

_MODULES: dict[tuple[str, bool], object] = {}
# Files built for sm_90a, the Hopper target that has wgmma (plain sm_90 does not). CuPy appends its own
# -arch=sm_90 after these options; NVRTC then builds sm_90a code (seen with NVRTC 12.9 here and 13.0 on an H100).
_SM90A = frozenset({"gemm_wgmma.cu", "attention_wgmma.cu"})


def load_module(name: str, ptx70: bool = False):
    """A ``cupy.RawModule`` for ``cuda/<name>``: NVRTC for the running GPU, or (``ptx70``) the compute_70 PTX
    from the pip NVRTC 12 JIT-compiled by the driver for whatever GPU is present."""
    key = (name, ptx70)
    mod = _MODULES.get(key)
    if mod is None:
        import cupy
        if ptx70:
            mod = cupy.RawModule(path=str(ptx70_path(name)))
        else:
            arch = ("-arch=sm_90a",) if name in _SM90A else ()
            mod = cupy.RawModule(code=source(name), options=("-std=c++17",) + arch)
        _MODULES[key] = mod
    return mod
