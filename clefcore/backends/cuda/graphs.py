"""CUDA graphs for short prefills: a prompt of a few hundred tokens is bound by the host (about 1,400 kernel and
cuBLAS launches from Python, ~45 us each on an H200), not by the GPU; replaying a captured graph costs one launch.

``GraphCache.run(key, fn, inputs)`` returns ``fn(*inputs)``. The first time a key is seen it runs eagerly (that
compiles the kernels and autotunes the GEMM shapes, neither of which may happen during a capture); the second
time it captures ``fn`` on a side stream into a graph whose memory is one ``clefcore.pool.Arena`` (one
cudaMalloc, never handed to anyone else): captured first in a trial arena (the largest need of the cache's graphs
so far, doubled until the graph fits), then, where the trial was larger than this graph needs, again in an arena
of its own extent plus reserve.py's margin. Not a CuPy pool: that is many small cudaMallocs, and the device does
not get back what they held when the graph is dropped (about 1 MiB a capture on an H100), while the head's
captures come with the traffic. Later calls copy the inputs into the graph's static input buffers and launch it.
What the graph reads and writes therefore stays valid for its whole life: the entry holds its arena, every index
table ``DeviceContext.upload`` returned during the capture and the weights the graph reads. A capture that fails
for any reason falls back to eager runs for that key and is logged: a graph may make a forward faster, never
wrong.
The guard flags that ``CudaOps.watch`` set up during the capture are re-zeroed by the graph itself (their
memsets are captured) and handed back to the device context after every launch, so ``check_watched`` reads them.
Three caches use it: the backbone's (per padded length), the vision tower's (per set of image sizes) and the
joint head's (per question schema and padded length, clefcore/model/head.py). A cache remembers the keys it has
seen, and those whose capture failed, only as far back as ``REMEMBERED`` keys: the head's keys come with the
traffic.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from ... import errors
from .reserve import GRANULE, MARGIN

log = logging.getLogger("clefcore.cuda")

REMEMBERED = 4096     # keys seen (or failed) that a cache remembers, the oldest forgotten first


class _Recent:
    """A set of at most ``size`` keys that forgets its oldest: forgetting a key seen once only means that its next
    sighting is taken for a first one (run eagerly), and a failed one is tried again."""

    def __init__(self, size: int):
        self.size = size
        self._keys: OrderedDict = OrderedDict()

    def __contains__(self, key) -> bool:
        return key in self._keys

    def add(self, key) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self.size:
            self._keys.popitem(last=False)

    def discard(self, key) -> None:
        self._keys.pop(key, None)


@dataclass
class _Entry:
    graph: object
    inputs: list          # static input buffers (the graph reads these addresses)
    output: object        # the array fn returned during the capture (the graph writes it)
    watched: list         # CudaOps.watch records made during the capture
    memory: object        # the Arena holding every activation of the graph
    reads: tuple          # the arrays besides the inputs that the graph reads (weights): held, and compared
    pinned: list = field(default_factory=list)


class GraphCache:
    """At most ``capacity`` graphs (least recently used dropped first); ``bucket`` tokens of padding granularity
    for the callers that pad (model.backbone); graphs only for prompts of at most ``max_tokens``. ``ctx``: the
    device context (device.py) whose uploads and guard records a capture collects."""

    def __init__(self, ctx, max_tokens: int = 1024, capacity: int = 4, bucket: int = 128):
        self.ctx = ctx
        self.max_tokens = int(max_tokens)
        self.capacity = int(capacity)
        self.bucket = int(bucket)
        self._graphs: OrderedDict = OrderedDict()
        self._seen = _Recent(REMEMBERED)
        self._failed = _Recent(REMEMBERED)
        self._stream = None          # the side stream every capture of this cache runs on (made at the first)
        self._largest = GRANULE      # the largest captured graph's need, the next trial's size
        self.launches = 0
        self.captures = 0

    def padded_tokens(self, T: int):
        """Tokens to pad a stream of ``T`` to (a multiple of ``bucket``, so nearby lengths share a graph), or None
        when a stream of that many runs eagerly (long streams, graphs off). The joint head pads packed streams too:
        what its launches do depends on no sequence bound (clefcore/model/head.py)."""
        if self.max_tokens <= 0 or self.capacity <= 0 or T < 1:
            return None
        Tp = -(-T // self.bucket) * self.bucket
        return Tp if Tp <= self.max_tokens else None

    def padded_length(self, T: int, n_seqs: int):
        """``padded_tokens`` for the backbone: a single-sequence prompt only (packed batches run eagerly)."""
        return self.padded_tokens(T) if n_seqs == 1 else None

    def fits(self, tokens: int) -> bool:
        """Whether a forward of ``tokens`` may replay a graph (callers that do not pad: the vision tower)."""
        return 0 < tokens <= self.max_tokens and self.capacity > 0

    def nbytes(self) -> int:
        return sum(e.memory.total_bytes() for e in self._graphs.values())

    def run(self, key, fn, inputs, reads):
        """``reads``: every array ``fn`` reads besides its inputs (the weights). Their addresses are baked into
        the graph, so the entry holds them (never freed under it) and is replayed only while the caller passes
        the very same arrays: a weight replaced by another array means a new capture, not a stale replay
        (changes made in place are seen by the graph, as by an eager run)."""
        reads = tuple(reads)
        e = self._graphs.get(key)
        if e is not None and (len(e.reads) != len(reads) or any(a is not b for a, b in zip(e.reads, reads))):
            del self._graphs[key]
            self._seen.discard(key)
            self._failed.discard(key)
            e = None
        if e is None:
            if key in self._failed or key not in self._seen:
                self._seen.add(key)
                return fn(*inputs)
            e = self._capture(key, fn, inputs, reads)
            if e is None:
                return fn(*inputs)
        else:
            self._graphs.move_to_end(key)
        cp = self.ctx.cp
        for dst, src in zip(e.inputs, inputs):
            cp.copyto(dst, src)
        e.graph.launch(stream=cp.cuda.get_current_stream())
        self.launches += 1
        self.ctx.watched.extend(e.watched)
        return e.output

    def _capture(self, key, fn, inputs, reads):
        # one side stream for all of them: what a library keeps per stream (a cuBLAS workspace) is made once, not
        # once per capture, and the head's captures come with the traffic
        if self._stream is None:
            self._stream = self.ctx.cp.cuda.Stream(non_blocking=True)
        self.ctx.cp.cuda.get_current_stream().synchronize()   # the inputs are ready before the side stream copies
        try:
            e = self._capture_in_arena(fn, inputs, reads)
        except Exception as exc:  # noqa: BLE001 - any capture failure means "run this key eagerly"
            log.warning("CUDA graph capture failed for %s (%s: %s); running it eagerly", key,
                        exc.__class__.__name__, exc)
            self._failed.add(key)
            return None
        self._graphs[key] = e
        self.captures += 1
        while len(self._graphs) > self.capacity:
            self._graphs.popitem(last=False)
        log.info("captured a CUDA graph for %s (%d graphs, %.1f MiB)", key, len(self._graphs), self.nbytes() / 2 ** 20)
        return e

    def _capture_in_arena(self, fn, inputs, reads):
        from ...pool import Arena     # compiled from pyx/pool.pyx
        device, size = self.ctx.device_id, self._largest
        while True:
            trial = Arena(size, device)                    # a DeviceError where the device has no such block
            try:
                e = self._capture_in(trial, fn, inputs, reads)
                break
            except errors.ArenaFull:
                size *= 2
        need = -(-int(trial.extent * MARGIN) // GRANULE) * GRANULE
        self._largest = max(self._largest, need)         # a graph that fits nowhere leaves it as it was
        if need < trial.capacity:
            try:                                           # this graph alone, without the trial's spare bytes
                e = self._capture_in(Arena(need, device), fn, inputs, reads)
            except errors.ArenaFull:                       # best fit placed it otherwise: the trial's is kept
                pass
        return e

    def _capture_in(self, memory, fn, inputs, reads):
        """One capture of ``fn`` with every allocation from ``memory`` (an Arena)."""
        ctx, cp, stream = self.ctx, self.ctx.cp, self._stream
        before = ctx.watched
        ctx.watched, ctx.pinned = [], []
        try:
            with cp.cuda.using_allocator(memory.malloc), stream:
                static = [x.copy() for x in inputs]
                stream.synchronize()
                stream.begin_capture()
                try:
                    out = fn(*static)
                finally:
                    graph = stream.end_capture()
                graph.upload(stream)
                stream.synchronize()
            return _Entry(graph, static, out, ctx.watched, memory, tuple(reads), ctx.pinned)
        finally:
            ctx.watched, ctx.pinned = before, None
