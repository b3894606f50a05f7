# cython: language_level=3, boundscheck=False, wraparound=False
"""The server's scheduler core: a bounded queue of prepared requests, ordered shortest first with aging, and
the packing of its head into one prefill batch.

The asyncio side (server/batcher.py) owns futures, clocks and threads; this module owns only the
bookkeeping that runs on every enqueue and every batch: capacity, token sums, cancelled and expired
entries. It holds no locks because it is only ever touched from the event loop thread.

Order: an entry's priority is its prompt size less what it earned by waiting, ``tokens - age_rate * waited``.
Both terms move together for every queued entry, so the order is that of the fixed key ``enqueued_at + tokens /
age_rate``, kept in a heap: a short request passes a long one that arrived less than (difference in tokens) /
age_rate seconds before it, and never more, so a long prompt is not starved by a stream of short ones.
``age_rate = inf`` is first-in first-out. A batch is the longest run of the heap's order that fits the token
budget and the request count; the head entry always goes, even alone over the budget, because it cannot get any
smaller by waiting.

Answer times: an entry may carry the time its answer was promised by (``answer_by``: admission judged it against
its budget, counting only its own run after the work ahead). Every entry of a batch is answered when the whole
batch ends, so a batch grows only while, at the device rate, it still ends by the promise of each entry in it that
could keep it. An entry that would be late in any batch (its promise is past even where it joins) still goes,
and does not shrink the batch: waiting would only make it later.
"""

import heapq
from libc.math cimport INFINITY


cdef class Entry:
    """One queued request. ``payload`` is opaque to the scheduler (the batcher keeps its prepared request
    and future there); ``tokens`` is the prompt length; ``deadline`` (given up) and ``answer_by`` (promised,
    inf: no promise) are on the caller's monotonic clock."""

    cdef public object payload
    cdef public long tokens
    cdef public double deadline
    cdef public double enqueued_at
    cdef public double answer_by
    cdef readonly bint cancelled
    cdef readonly bint queued

    def __init__(self, object payload, long tokens, double deadline, double enqueued_at,
                 double answer_by=INFINITY):
        if tokens < 0:
            raise ValueError("tokens must be >= 0")
        self.payload = payload
        self.tokens = tokens
        self.deadline = deadline
        self.enqueued_at = enqueued_at
        self.answer_by = answer_by
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
    once, although it is physically removed later, when packing reaches it. ``age_rate``: prompt tokens of
    priority an entry earns per second of waiting (see the module doc). ``waiting_since``: the arrival of the
    entry that last found the queue empty, so while any is queued, since when some always was."""

    cdef list _heap
    cdef dict _keys      # live entry -> its order key, in push order: what admission weighs them by
    cdef long _seq
    cdef readonly long capacity
    cdef readonly double age_rate
    cdef readonly long live
    cdef readonly long live_tokens
    cdef readonly double waiting_since

    def __init__(self, long capacity, double age_rate=float("inf")):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        if not age_rate > 0:
            raise ValueError("age_rate must be > 0 tokens per second")
        self._heap = []
        self._keys = {}
        self._seq = 0
        self.capacity = capacity
        self.age_rate = age_rate
        self.live = 0
        self.live_tokens = 0
        self.waiting_since = 0.0

    def __len__(self):
        return self.live

    cpdef set_age_rate(self, double age_rate):
        """Change the aging rate for entries pushed from now on (the server follows its measured device rate).
        Entries already queued keep the key they were pushed with: the heap stays valid, and their order
        against newer entries is off by at most the change in rate, which only shifts who ages faster."""
        if not age_rate > 0:
            raise ValueError("age_rate must be > 0 tokens per second")
        self.age_rate = age_rate

    cpdef bint full(self):
        return self.live >= self.capacity

    cpdef bint push(self, Entry entry):
        """Queue ``entry``; False (and nothing queued) when the queue is full."""
        cdef double key
        if self.live >= self.capacity:
            return False
        if entry.queued or entry.cancelled:
            raise ValueError("entry is already queued or cancelled")
        if self.live == 0:
            self.waiting_since = entry.enqueued_at
        key = entry.enqueued_at + entry.tokens / self.age_rate
        # seq breaks ties in arrival order (and keeps the heap from ever comparing two entries)
        heapq.heappush(self._heap, (key, self._seq, entry))
        self._keys[entry] = key
        self._seq += 1
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
            del self._keys[entry]

    cpdef double key(self, long tokens, double now):
        """The order key an entry of ``tokens`` pushed at ``now`` would get (smaller runs first)."""
        return now + tokens / self.age_rate

    cpdef double head_key(self):
        """The key of the entry that runs next, inf when none is queued (cancelled heads are dropped here)."""
        cdef Entry entry
        while self._heap:
            entry = <Entry>self._heap[0][2]
            if not entry.cancelled:
                return self._heap[0][0]
            heapq.heappop(self._heap)
            entry.queued = False
        return float("inf")

    cpdef object head(self):
        """The entry that runs next, None when none is queued."""
        return self._heap[0][2] if self.head_key() != float("inf") else None

    cpdef tuple keyed(self):
        """The live entries with their order keys, ``(entry, key)`` in push order (O(queue))."""
        return tuple(self._keys.items())

    cpdef long tokens_before(self, double key):
        """Prompt tokens of the live entries that run before one of order ``key``: the work ahead of a new
        short request, which is what its wait depends on (O(queue), bounded by ``capacity``)."""
        cdef long total = 0
        cdef Entry entry
        for item in self._heap:
            entry = <Entry>item[2]
            if not entry.cancelled and item[0] <= key:
                total += entry.tokens
        return total

    cpdef Batch take(self, long max_tokens, long max_requests, double now, double rate=INFINITY):
        """Remove and return the next batch: the longest run of the queue's order with at most ``max_requests``
        entries and at most ``max_tokens`` prompt tokens (the first entry always goes) that, run at ``rate``
        tokens per second from ``now``, ends by every kept promise in it (module doc; inf: promises are not
        weighed). Cancelled and expired entries met on the way are removed and reported, never run."""
        cdef Batch batch = Batch()
        cdef Entry entry
        cdef list heap = self._heap
        cdef double ends, answer_by = INFINITY   # the batch's end if it takes this entry; its earliest kept promise
        while heap:
            entry = <Entry>heap[0][2]
            if entry.cancelled:
                heapq.heappop(heap)
                entry.queued = False
                batch.cancelled.append(entry)
                continue
            if entry.deadline <= now:
                heapq.heappop(heap)
                entry.queued = False
                self.live -= 1
                self.live_tokens -= entry.tokens
                del self._keys[entry]
                batch.expired.append(entry)
                continue
            if len(batch.entries) >= max_requests:
                break
            if batch.entries and batch.tokens + entry.tokens > max_tokens:
                break
            ends = now + (batch.tokens + entry.tokens) / rate
            if batch.entries and ends > answer_by:
                break
            if ends <= entry.answer_by:
                answer_by = min(answer_by, entry.answer_by)
            heapq.heappop(heap)
            entry.queued = False
            self.live -= 1
            self.live_tokens -= entry.tokens
            del self._keys[entry]
            batch.entries.append(entry)
            batch.tokens += entry.tokens
        return batch

    cpdef list drain(self):
        """Remove every live entry, in queue order (past the drain timeout, or when the devices fail)."""
        cdef list out = []
        cdef Entry entry
        while self._heap:
            entry = <Entry>heapq.heappop(self._heap)[2]
            entry.queued = False
            if not entry.cancelled:
                out.append(entry)
        self.live = 0
        self.live_tokens = 0
        self._keys.clear()
        return out
