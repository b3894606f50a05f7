"""Sizing the activation arena (clefcore.pool.Arena) by running the worst case in it.

How much device memory a forward needs depends on the model, the token block, the packed batch's shape and the
chunked prompt carried beside it; counting it by hand goes stale with every kernel change. So the caller passes
the largest work it will ever ask for as a callable, and it runs three times:

0. outside any arena, to compile, autotune and fill the backend's caches (a cache entry made inside the trial
   arena would keep its whole reservation alive). The index tables that the device context memoises across
   forwards get an arena of their own (``UPLOADS``), made first: in the forwards' arena they would pin holes
   between forwards;
1. in a trial arena of all the free memory but ``HEADROOM``: the highest byte it touched (``Arena.extent``) is
   the need;
2. in the arena kept, of that need plus ``MARGIN`` for fragmentation, rounded up to ``GRANULE``. This run is the
   proof that the worst case fits the arena as reserved (best fit in a smaller arena may place pieces
   differently); it also warms up every kernel and GEMM shape at those sizes. Should an array of the trial
   outlive it (a cache filled during a forward: a bug), the trial cannot be given back and is kept instead,
   logged, so that the server still starts.

From then on every forward between ``begin_forward`` and ``end_forward`` is carved from the arena: no request
within the limits calls cudaMalloc or can run out of memory. Work the worst case does not cover (the vision
tower's activations) overflows into CuPy's pool, counted (``Arena.overflows``, /health). The CUDA graphs of
short prompts keep their own arenas outside this one; a graph that finds no memory is not captured and its
prompt runs eagerly, in the arena."""

from __future__ import annotations

import gc
import logging
from typing import Callable

from ... import errors

log = logging.getLogger("clefcore")

HEADROOM = 512 << 20     # outside the trial arena: cuBLAS workspaces and the driver's own allocations
MARGIN = 1.05            # fragmentation: real traffic frees and reuses in another order than the worst case
GRANULE = 2 << 20
UPLOADS = 16 << 20       # the memoised index tables: a 24k-token prompt's largest is ~100 KB; full = start over


def _run(ops, worst_case, where: str) -> None:
    """worst_case() to completion; running out of device memory (CuPy's pool, or a cuBLAS workspace that
    cudaMalloc could not give) becomes a DeviceError that says where."""
    try:
        worst_case()
        ops.synchronize()
    except errors.DeviceError:
        raise
    except Exception as error:   # noqa: BLE001 - only out-of-memory errors are translated, the rest re-raised
        if not (isinstance(error, ops.ctx.cp.cuda.memory.OutOfMemoryError) or "ALLOC_FAILED" in str(error)):
            raise
        free, total = ops.ctx.cp.cuda.runtime.memGetInfo()
        raise errors.DeviceError(f"out of device memory {where} ({free} of {total} bytes free beyond the "
                                 f"weights: {type(error).__name__}: {error})") from None


def reserve(ops, worst_case: Callable[[], None]):
    """The arena for ``worst_case`` on ``ops``'s device, left active as ``ops.arena``; raises DeviceError with
    the numbers when the device cannot hold it."""
    from ...pool import Arena     # compiled from pyx/pool.pyx
    ctx = ops.ctx
    cp = ctx.cp
    ops.arena = None
    ctx.caches.uploads.clear()
    ctx.caches.upload_arena = Arena(UPLOADS, ctx.device_id, overflow=True)
    _run(ops, worst_case, "on the first run, outside any arena")
    cp.get_default_memory_pool().free_all_blocks()
    free, _ = cp.cuda.runtime.memGetInfo()
    trial_bytes = max(free - HEADROOM, GRANULE)
    trial = ops.arena = Arena(trial_bytes, ctx.device_id)
    try:
        _run(ops, worst_case, "in the trial arena")
    except errors.DeviceError as error:
        raise errors.DeviceError(f"the largest work needs more than the {trial_bytes} bytes free beyond the "
                                 f"weights and {HEADROOM} bytes of headroom ({error})") from None
    finally:
        ops.arena = None
        gc.collect()
    if trial.in_use:     # an array made in the trial outlived it: the trial's memory cannot be given back, so it
        log.warning("%d bytes made while sizing the reservation outlived the run: serving from the whole %d-byte "
                    "trial arena (CUDA graphs will find no memory and run eagerly)", trial.in_use, trial_bytes)
        ops.arena = trial
        return trial
    need = int(trial.extent)
    del trial
    size = -(-int(need * MARGIN) // GRANULE) * GRANULE
    ops.arena = Arena(size, ctx.device_id, overflow=True)
    _run(ops, worst_case, "in the arena kept")
    if ops.arena.overflows:    # best fit placed the same work differently in the smaller arena
        overflow, ops.arena = ops.arena.overflow_bytes, None
        raise errors.DeviceError(f"the largest work ran in {need} bytes but not in an arena of {size} "
                                 f"({overflow} bytes overflowed)")
    return ops.arena
