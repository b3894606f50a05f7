"""How ``clefcore bench`` times: GPU time between CUDA events (one kernel or a few, queued or replayed from a
graph) for the kernel table, wall time around work that waits for its own device for the end-to-end cases and
the transformers peer, and the spread of the timed runs printed beside their median."""

from __future__ import annotations

import statistics
import time


def spread(ts) -> str:
    """The timed runs' range, printed beside their median: a wide range flags a disturbed measurement."""
    return f"{min(ts):.1f}-{max(ts):.1f} ms"


def wall_ms(fn, reps) -> float:
    """Median wall time of ``fn`` (which waits for its own device work) after one warm-up call."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def gpu_ms(cp, fn, reps=5, warm=1, inner=1):
    """Median over ``reps`` of the GPU time per call, ``inner`` calls queued back to back between the events
    (so that Python's launch overhead, several host calls per split GEMM, does not show as GPU time)."""
    for _ in range(warm):
        fn()
    cp.cuda.Device().synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        for _ in range(inner):
            fn()
        e1.record()
        e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1) / inner)
    return statistics.median(ts)


def graph_ms(cp, fn, n=20, reps=5):
    """gpu_ms of ``fn`` (kernel launches, no host sync) replayed ``n`` times from one CUDA graph, per call: for
    kernels of a few microseconds, where even queued Python launches would set the time."""
    fn()
    cp.cuda.Device().synchronize()
    s = cp.cuda.Stream(non_blocking=True)
    with s:                                   # captured, then timed, on s (events record on the current stream)
        s.begin_capture()
        for _ in range(n):
            fn()
        g = s.end_capture()
        return gpu_ms(cp, lambda: g.launch(s), reps=reps) / n
