"""Wall-clock timing helpers shared by ``clefcore bench`` and the transformers peer it measures against."""

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
