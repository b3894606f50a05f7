# cython: language_level=3, boundscheck=False, wraparound=False
"""The server's scheduler core: a bounded FIFO queue of prepared requests and the packing of its head
into one prefill batch.

The asyncio side (server/batcher.py) owns futures, clocks and threads; this module owns only the
bookkeeping that runs on every enqueue and every batch: capacity, token sums, cancelled and expired
entries. It holds no locks because it is only ever touched from the event loop thread.

Packing is strictly first-in first-out: a batch is the longest prefix of the live queue that fits the
token budget and the request count. A small request never overtakes a large one that arrived earlier
(that would starve large prompts under steady load). The head entry is always taken, even when it alone
exceeds the token budget, because it cannot get any smaller by waiting.
"""

from collections import deque


cdef class Entry:
    """One queued request. ``payload`` is opaque to the scheduler (the batcher keeps its prepared request
    and future there); ``tokens`` is the prompt length; ``deadline`` is on the caller's monotonic clock."""

    cdef public object payload
    cdef public long tokens
    cdef public double deadline
    cdef public double enqueued_at
    cdef readonly bint cancelled
    cdef readonly bint queued

    def __init__(self, object payload, long tokens, double deadline, double enqueued_at):
        if tokens < 0:
            raise ValueError("tokens must be >= 0")
        self.payload = payload
        self.tokens = tokens
        self.deadline = deadline
        self.enqueued_at = enqueued_at
        self.cancelled = False
        self.queued = False


cdef class Batch:
    """What one call to ``Scheduler.take`` hands out: the entries to run, in queue order, and the entries
    that were dropped on the way (cancelled by their client, or past their deadline)."""

    cdef readonly list entries
    cdef readonly list expired
    cdef readonly list cancelled
    cdef readonly long tokens

    def __cinit__(self):
        self.entries = []
        self.expired = []
        self.cancelled = []
        self.tokens = 0


cdef class Scheduler:
    """Bounded queue. ``capacity`` counts live entries only: a cancelled entry stops occupying a slot at
    once, although it is physically removed later, when packing reaches it."""

    cdef object _queue
    cdef readonly long capacity
    cdef readonly long live
    cdef readonly long live_tokens

    def __init__(self, long capacity):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._queue = deque()
        self.capacity = capacity
        self.live = 0
        self.live_tokens = 0

    def __len__(self):
        return self.live

    cpdef bint full(self):
        return self.live >= self.capacity

    cpdef bint push(self, Entry entry):
        """Append ``entry``; False (and nothing queued) when the queue is full."""
        if self.live >= self.capacity:
            return False
        if entry.queued or entry.cancelled:
            raise ValueError("entry is already queued or cancelled")
        self._queue.append(entry)
        entry.queued = True
        self.live += 1
        self.live_tokens += entry.tokens
        return True

    cpdef cancel(self, Entry entry):
        """Mark a queued entry as abandoned by its client. Idempotent; a no-op for entries already taken."""
        if entry.cancelled:
            return
        entry.cancelled = True
        # An entry that already left the queue is no longer counted; only queued ones give their slot back.
        if entry.queued:
            self.live -= 1
            self.live_tokens -= entry.tokens

    cpdef Batch take(self, long max_tokens, long max_requests, double now):
        """Remove and return the next batch: the longest live FIFO prefix with at most ``max_requests``
        entries and at most ``max_tokens`` prompt tokens (the first entry always goes). Cancelled and
        expired entries met on the way are removed and reported, never run."""
        cdef Batch batch = Batch()
        cdef Entry entry
        cdef object queue = self._queue
        while queue:
            entry = <Entry>queue[0]
            if entry.cancelled:
                queue.popleft()
                entry.queued = False
                batch.cancelled.append(entry)
                continue
            if entry.deadline <= now:
                queue.popleft()
                entry.queued = False
                self.live -= 1
                self.live_tokens -= entry.tokens
                batch.expired.append(entry)
                continue
            if len(batch.entries) >= max_requests:
                break
            if batch.entries and batch.tokens + entry.tokens > max_tokens:
                break
            queue.popleft()
            entry.queued = False
            self.live -= 1
            self.live_tokens -= entry.tokens
            batch.entries.append(entry)
            batch.tokens += entry.tokens
        return batch

    cpdef list drain(self):
        """Remove every live entry (used when shutting down past the drain timeout)."""
        cdef list out = []
        cdef Entry entry
        while self._queue:
            entry = <Entry>self._queue.popleft()
            entry.queued = False
            if not entry.cancelled:
                out.append(entry)
        self.live = 0
        self.live_tokens = 0
        return out
