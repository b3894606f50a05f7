"""The GEMM autotune's choice logic (CudaOps._choose) on a fake event clock: no GPU needed."""

import types

from clefcore.backends.cuda.ops import CudaOps
from clefcore.backends.cuda.state import GemmChoices
from clefcore.precision import Plan


class _Clock:
    def __init__(self):
        self.t = 0.0
        clock = self

        class Event:
            def record(self):
                self.t = clock.t

            def synchronize(self):
                pass
        self.cuda = types.SimpleNamespace(Event=Event, get_elapsed_time=lambda a, b: b.t - a.t)


def _ops(mode="auto"):
    return types.SimpleNamespace(gemm=GemmChoices(mode), plan=Plan("split"), cp=_Clock(), cublas_missing=None)


def _path(ops, calls, name, cost, hiccup_on=None):
    def run():
        calls[name] = calls.get(name, 0) + 1
        ops.cp.t += cost + (10.0 if calls[name] == hiccup_on else 0.0)
    return run


def test_a_hiccup_on_one_timed_run_does_not_pick_the_slower_path():
    ops, calls = _ops(), {}
    paths = {"cublas": _path(ops, calls, "cublas", 1.0, hiccup_on=2), "wmma": _path(ops, calls, "wmma", 2.0)}
    assert CudaOps._choose(ops, 300, 64, 64, paths, "t") == "cublas"
    assert calls == {"cublas": 6, "wmma": 6}                  # one warm-up run + 5 timed runs each
    assert ops.gemm.chosen == {(64, 64, 512, "t", "split"): "cublas"}


def test_the_choice_is_kept_per_shape_bucket_and_a_forced_mode_wins():
    ops, calls = _ops(), {}
    paths = {"cublas": _path(ops, calls, "cublas", 3.0), "wmma": _path(ops, calls, "wmma", 2.0)}
    assert CudaOps._choose(ops, 300, 64, 64, paths, "t") == "wmma"
    n = dict(calls)
    assert CudaOps._choose(ops, 512, 64, 64, paths, "t") == "wmma" and calls == n     # same bucket: not re-timed
    assert CudaOps._choose(ops, 513, 64, 64, paths, "t") == "wmma" and calls != n     # next bucket: timed
    assert CudaOps._choose(_ops("cublas"), 300, 64, 64, paths, "t") == "cublas"


def test_without_cublas_its_path_is_never_run_or_chosen():
    ops, calls = _ops(), {}
    ops.cublas_missing = "libcublasLt.so.12: cannot open shared object file"
    paths = {"cublas": _path(ops, calls, "cublas", 1.0), "wmma": _path(ops, calls, "wmma", 2.0),
             "rows": _path(ops, calls, "rows", 3.0)}
    assert CudaOps._choose(ops, 300, 64, 64, paths, "t") == "wmma"
    assert "cublas" not in calls and calls["rows"] == 6


def test_gemm_paths_records_each_choice_inside_its_block_only():
    """CudaOps.gemm_paths: every _choose inside the block is recorded under the autotune's key, a pinned mode's
    too; nothing is recorded before or after it."""
    ops, calls = _ops(), {}
    paths = {"cublas": _path(ops, calls, "cublas", 1.0), "wmma": _path(ops, calls, "wmma", 2.0)}
    CudaOps._choose(ops, 300, 64, 64, paths, "before")
    with CudaOps.gemm_paths(ops) as seen:
        CudaOps._choose(ops, 300, 64, 64, paths, "t")
        ops.gemm.pin = "wmma"
        CudaOps._choose(ops, 20, 128, 64, paths, "t")
    ops.gemm.pin = "auto"
    CudaOps._choose(ops, 300, 64, 64, paths, "after")
    assert seen == {(64, 64, 512, "t", "split"): "cublas", (128, 64, 32, "t", "split"): "wmma"}
    assert ops.gemm.seen is None
