"""The GPU arena (clefcore.pool): FreeList against a brute-force model of the bytes; the device part on a
GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pool = pytest.importorskip("clefcore.pool")
from gpu_only import HAVE_CUBLAS, HAVE_GPU  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def test_freelist_best_fit_coalesce_and_errors():
    f = pool.FreeList(1000)
    a, b, c = f.take(100), f.take(200), f.take(300)
    assert (a, b, c) == (0, 100, 300) and f.in_use == 600
    f.give(b, 200)                                   # hole [100, 300)
    assert f.take(150) == 100                        # best fit: the 200-byte hole, not the 400-byte tail
    assert f.take(500) == -1 and f.largest_free() == 400
    f.give(a, 100)
    with pytest.raises(ValueError, match="double free"):
        f.give(a, 100)
    with pytest.raises(ValueError):
        f.give(900, 200)                             # beyond the capacity
    f.give(100, 150)
    f.give(c, 300)
    assert f.take(100) == 0 and f.take(200) == 100   # the holes merged back: first fit from the start
    f.give(0, 300)
    assert f.ranges() == [(0, 1000)] and f.in_use == 0 and f.high_water == 600
    assert f.extent == 600                           # [0, 600) was the most ever touched at once


@pytest.mark.parametrize("seed", range(5))
def test_freelist_never_hands_out_a_byte_twice(seed):
    rng = np.random.default_rng(seed)
    cap = 1 << 16
    f = pool.FreeList(cap)
    owner = np.zeros(cap, np.int64)                  # 0 = free, k = handed out to allocation k
    live = {}
    for k in range(1, 3000):
        if live and rng.random() < 0.45:
            key = list(live)[rng.integers(len(live))]
            start, size = live.pop(key)
            assert np.all(owner[start:start + size] == key)
            owner[start:start + size] = 0
            f.give(start, size)
        else:
            size = int(rng.integers(1, 40)) * 64
            start = f.take(size)
            if start < 0:                            # only when no free run of that length exists
                runs = np.diff(np.flatnonzero(np.diff(np.r_[1, owner != 0, 1])))[::2]
                assert runs.max(initial=0) < size
                continue
            assert np.all(owner[start:start + size] == 0)
            owner[start:start + size] = k
            live[k] = (start, size)
        assert f.in_use == int(np.count_nonzero(owner))
        assert sum(s for _, s in f.ranges()) == cap - f.in_use
        touched = np.flatnonzero(owner)
        assert f.extent >= (touched[-1] + 1 if len(touched) else 0) and f.extent >= f.high_water
    for start, size in live.values():
        f.give(start, size)
    assert f.ranges() == [(0, cap)]


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device visible to CuPy")
def test_arena_on_the_gpu():
    import cupy

    from clefcore.backends.cuda import CudaOps
    from clefcore.checkpoint import Checkpoint
    from clefcore.errors import DeviceError
    from clefcore.model.backbone import backbone
    from clefcore.model.params import load_params

    arena = pool.Arena(64 << 20, 0)
    arena.activate()
    x = cupy.arange(1000, dtype=cupy.float32)
    inside = arena.base <= x.data.ptr < arena.base + arena.capacity
    used = arena.in_use
    del x
    arena.deactivate()
    assert inside and used >= 4000 and arena.in_use == 0
    with pytest.raises(DeviceError, match=r"asked for 134217728 bytes; largest free piece 67108864"):
        arena.alloc(128 << 20)

    ck = Checkpoint(Path(__file__).parent / "golden" / "model")
    gemm = "cublas" if HAVE_CUBLAS else "wmma"     # one GEMM path for both, whichever this machine can load
    ops = CudaOps(0, token_block=64, gemm=gemm)
    ref = CudaOps(0, token_block=64, gemm=gemm)
    p, pr = load_params(ck, ops), load_params(ck, ref)
    ids = np.arange(300) % 1900
    cu, pos = np.array([0, 130, 300]), np.r_[np.arange(130), np.arange(170)]

    def forward():
        ops.begin_forward()
        try:
            return ops.to_host(backbone(ops, p, ids, cu, pos)[0])
        finally:
            ops.end_forward()

    reserved = ops.reserve(forward)
    tables = ops.ctx.caches.upload_arena
    assert reserved == ops.arena.capacity + tables.capacity
    assert ops.arena.extent <= ops.arena.capacity < 2 * ops.arena.extent + (4 << 20)
    default = cupy.get_default_memory_pool()
    before = default.total_bytes()
    for _ in range(2):                               # each forward reuses the last one's ranges
        h = forward()
    assert default.total_bytes() == before           # nothing came from CuPy's own pool: no cudaMalloc
    assert ops.arena.in_use == 0                     # and everything went back: the memoised index tables
    assert tables.in_use > 0 and tables.overflows == 0   # live in an arena of their own
    want = ref.to_host(backbone(ref, pr, ids, cu, pos)[0])
    assert np.max(np.abs(h - want)) <= 1e-5 * np.max(np.abs(want))

    # a worst case larger than the device: the error says how much there was
    free = cupy.cuda.runtime.memGetInfo()[0]
    small = CudaOps(0, token_block=64, gemm=gemm)
    ballast = cupy.empty(free - (600 << 20), dtype=cupy.uint8)   # leaves the headroom and ~88 MiB

    def too_big():
        small.begin_forward()
        try:
            cupy.empty(256 << 20, dtype=cupy.uint8)
        finally:
            small.end_forward()
    with pytest.raises(DeviceError, match=r"needs more than the \d+ bytes free .*asked for 268435456 bytes"):
        small.reserve(too_big)
    assert small.arena is None
    del ballast


def run_child(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python -c code` importing the installed clefcore. `-c` puts the working directory first on sys.path:
    from the repo root, the child would import the source tree's clefcore (without the compiled pool module)
    whenever the package is installed non-editable; so it runs elsewhere, and PYTHONPATH loses any entry
    into the source tree."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd,
                          env=_child_env())


def _child_env() -> dict:
    env = dict(os.environ)
    if env.get("PYTHONPATH"):
        root = REPO.resolve()
        keep = [p for p in env["PYTHONPATH"].split(os.pathsep)
                if p and Path(p).resolve() != root and root not in Path(p).resolve().parents]
        env["PYTHONPATH"] = os.pathsep.join(keep)
    return env


def test_child_probe_imports_the_installed_package(tmp_path):
    """The probe's child process must get the package pytest itself imported, not ./clefcore."""
    code = "import clefcore.pool, clefcore; print(clefcore.pool.__file__)"
    run = run_child(code, tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert Path(run.stdout.strip()).resolve() == Path(pool.__file__).resolve()


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="no CUDA device visible to CuPy")
def test_arena_dying_in_a_cycle_with_live_pieces(tmp_path):
    """An engine that holds its arena and arrays cut from it dies as one reference cycle, which the collector
    clears object by object (roughly in creation order, so the arena, made first, tends to go first). The arena
    must still take its pieces back afterwards: while it had a tp_clear, this was a segfault inside gc. Run in a
    child process so that a crash fails this test alone."""
    code = (
        "import gc, cupy\n"
        "from clefcore import pool\n"
        "class Engine: pass\n"
        "for _ in range(20):\n"
        "    arena = pool.Arena(1 << 20, 0)\n"
        "    e = Engine(); e.arena, e.me = arena, e\n"
        "    arena.activate(); e.bufs = [cupy.zeros(1000 + i, cupy.float32) for i in range(8)]; arena.deactivate()\n"
        "    del arena, e\n"
        "    assert gc.collect() > 0\n"
        "print('collected')\n")
    run = run_child(code, tmp_path)
    assert run.returncode == 0 and run.stdout.strip() == "collected", (run.returncode, run.stderr[-2000:])
    assert "Exception ignored" not in run.stderr, run.stderr[-2000:]
