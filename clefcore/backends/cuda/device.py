"""``DeviceContext``: the one GPU every op object of the CUDA backend works on (norms.py, matmul.py, attention.py,
delta_rule.py, head.py, vision.py), and the plumbing they all use: the compiled kernels, what the kernel choices
read (clefcore/kernel_select.py), the memos, and the array helpers (fp32 and fp16 operands, row maps, uploads of
index tables, grids)."""

from __future__ import annotations

import numpy as np

from ... import errors, kernel_select
from ...precision import Plan
from . import cublas
from .compile import load_module
from .elementwise import ELEM_THREADS
from .state import Caches


def row_map(shape, strides, itemsize):
    """How a kernel walks x [..., D] (its shape and byte strides) as R rows of D in place: row r starts
    (r // heads) * rs + (r % heads) * hs elements in. (rs, 1, 0) when every leading axis collapses onto one row
    stride; (token stride, H, head stride) for a [T, H, D] view whose rows do not (the q columns of the conv
    output viewed per head); None when neither fits (the caller copies)."""
    if not shape:
        return None
    D = shape[-1]
    if strides[-1] != itemsize and D != 1:
        return None
    stride, expect, uniform = None, None, True
    for n, s in reversed(list(zip(shape[:-1], strides[:-1]))):   # leading axes, innermost first
        if n == 1:
            continue
        if expect is None:
            stride = s
        elif s != expect:
            uniform = False
            break
        expect = s * n
    if uniform:
        rs = (stride if stride is not None else D * itemsize) // itemsize
        if (stride is None or stride % itemsize == 0) and rs >= D:
            return rs, 1, 0
    if (len(shape) == 3 and strides[-1] == itemsize and strides[0] % itemsize == 0 and strides[1] % itemsize == 0
            and strides[1] >= D * itemsize and strides[0] > 0):
        return strides[0] // itemsize, shape[1], strides[1] // itemsize
    return None


class DeviceContext:
    """One GPU as CuPy sees it: its properties, the current precision plan and kernel switches (``setting``), the
    compiled kernels (``kernel``), the memos (``caches``) and the host <-> device traffic: uploads staged in pinned
    memory (``staged``), and during a CUDA graph's capture the index tables the graph reads (``pinned``,
    graphs.py). ``watched``: the guard flags set up by ``CudaOps.watch``, read by ``check_watched``."""

    plan: Plan                   # the next forward's kernel path (CudaOps sets it; ``fallback`` switches it)
    switches: frozenset          # the kernel switches in effect (clefcore/switches.py)

    def __init__(self, cupy, device_id: int, ptx70: bool, token_block: int):
        self.cp = cupy
        self.device_id = int(device_id)
        self.device = cupy.cuda.Device(self.device_id)
        self.device.use()
        props = cupy.cuda.runtime.getDeviceProperties(self.device_id)
        self.device_name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.cc = (props["major"], props["minor"])
        self.max_smem_optin = int(props.get("sharedMemPerBlockOptin", 49152))
        self.sm_count = int(props["multiProcessorCount"])
        # Without a loadable cuBLAS (an image that leaves the CUDA math libraries out) every matmul runs
        # clefcore's own kernels; said once by CudaOps, and shown by the server's /health and /metrics.
        self.cublas_missing = cublas.missing()
        self.ptx70 = bool(ptx70)
        # model.backbone runs every layer over blocks of token_block tokens (layer-outer, block-inner), so the
        # activations beyond the residual stream and the K/V cache are [token_block, *]; 0 = whole stream
        self.token_block = int(token_block)
        self.caches = Caches()
        self.pinned = None           # during a graph capture: the uploads the graph reads (graphs.py)
        self.staged = []             # pinned host buffers of asynchronous uploads still in flight
        self.watched = []

    @property
    def caps(self) -> kernel_select.Device:
        """What the kernel choices read of this GPU (clefcore/kernel_select.py)."""
        return kernel_select.Device(self.cc, not self.ptx70, self.max_smem_optin, self.cublas_missing is None)

    @property
    def setting(self) -> kernel_select.Setting:
        """What every kernel choice reads: the plan's row now (``fallback`` switches it), the switches, the GPU."""
        return kernel_select.Setting(self.plan.row, self.switches, self.caps)

    def kernel(self, module: str, name: str, smem: int = 0):
        key = (module, name)
        fn = self.caches.functions.get(key)
        if fn is None:
            fn = load_module(module, self.ptx70).get_function(name)
            self.caches.functions[key] = fn
        if smem > 49152 and self.caches.smem.get(key, 0) < smem:
            if smem > self.max_smem_optin:
                raise errors.DeviceError(f"{name} needs {smem} bytes of shared memory; the device allows "
                                         f"{self.max_smem_optin}")
            fn.max_dynamic_shared_size_bytes = smem
            self.caches.smem[key] = smem
        return fn

    def grid1(self, n):
        """The grid of elementwise.cu-style kernels over n values: ELEM_THREADS a block, grid-stride past the cap."""
        return (int(min(max(1, -(-n // ELEM_THREADS)), 65535 * 8)),)

    def f32(self, x):
        cp = self.cp
        x = cp.asarray(x)
        if x.dtype != cp.float32:
            x = x.astype(cp.float32)
        return x

    def contiguous(self, x):
        """fp32, C-contiguous, 16-byte aligned."""
        x = self.f32(x)
        if not x.flags.c_contiguous or x.data.ptr % 16:
            x = self.cp.ascontiguousarray(x)
            if x.data.ptr % 16:
                x = x.copy()
        return x

    def half(self, x):
        """fp16, C-contiguous, 16-byte aligned; an fp16 array already so is returned as it is."""
        cp = self.cp
        if isinstance(x, cp.ndarray) and x.dtype == cp.float16 and x.flags.c_contiguous and x.data.ptr % 16 == 0:
            return x
        x = self.contiguous(x)
        y = cp.empty(x.shape, dtype=cp.float16)
        self.kernel("gemm.cu", "to_half")(self.grid1(x.size), (ELEM_THREADS,), (x, y, np.int64(x.size)))
        return y

    def row_map(self, x):
        """x [..., D] as R rows of D read in place where ``row_map`` allows, else a contiguous copy.
        -> (x, R, D, rs, heads, hs)"""
        x = self.f32(x)
        D = x.shape[-1]
        R = int(np.prod(x.shape[:-1], dtype=np.int64)) if x.ndim > 1 else 1
        m = row_map(x.shape, x.strides, x.itemsize)
        if m is None:
            x = self.cp.ascontiguousarray(x)
            m = (D, 1, 0)
        return (x, R, D) + m

    def rows(self, x):
        """View x [..., D] as R rows of D with one uniform row stride (elements); copies if it cannot."""
        x, R, D, rs, heads, _ = self.row_map(x)
        if heads > 1:
            x = self.cp.ascontiguousarray(x)
            rs = D
        return x, R, D, rs

    def upload(self, a: np.ndarray):
        """A small host index table (tiles, chunks, row starts) on the device, memoised by content: every layer
        of a forward asks for the same tables. During a graph capture a table must already be here (a copy
        recorded into the graph would re-read a staging buffer that is gone by then): the capture fails and
        that prompt runs eagerly."""
        a = np.ascontiguousarray(a)
        key = (a.dtype.str, a.shape, a.tobytes())
        uploads = self.caches.uploads
        d = uploads.get(key)
        if d is None:
            if self.pinned is not None:
                raise errors.DeviceError("index table upload during a CUDA graph capture")
            arena = self.caches.upload_arena
            if len(uploads) >= 256 or (arena is not None and arena.free.largest_free() < a.nbytes):
                uploads.clear()      # tables a CUDA graph reads stay alive with it
            if arena is None:
                d = self.to_device(a)
            else:
                with self.cp.cuda.using_allocator(arena.malloc):
                    d = self.to_device(a)
            uploads[key] = d
        if self.pinned is not None:
            self.pinned.append(d)
        return d

    def to_device(self, a: np.ndarray):
        """Host -> device without waiting for the GPU: a copy from pageable memory first drains the stream, which
        would stop the host from queueing the head while the backbone runs. The data is staged in pinned memory
        and copied asynchronously on the current stream; the staging buffers are kept until the next host read
        (``to_host``, ``CudaOps.check_watched``), by which point the stream has passed their copies."""
        cp = self.cp
        a = np.ascontiguousarray(a)
        if self.pinned is not None:
            # a copy recorded into a graph would re-read a staging buffer that is gone by its replay
            raise errors.DeviceError(f"host upload of {a.shape} {a.dtype} during a CUDA graph capture")
        if a.size == 0:
            return cp.asarray(a)
        import cupyx
        staged = cupyx.empty_pinned(a.shape, a.dtype)
        staged[...] = a
        d = cp.empty(a.shape, a.dtype)
        d.set(staged, stream=cp.cuda.get_current_stream())
        self.staged.append(staged)
        return d

    def asarray(self, x):
        return self.to_device(x) if isinstance(x, np.ndarray) else self.cp.asarray(x)

    def to_host(self, x) -> np.ndarray:
        if not isinstance(x, self.cp.ndarray):
            return np.asarray(x)
        out = self.cp.asnumpy(x)              # waits for the stream: every staged upload before it is done
        self.staged.clear()
        return out
