# cython: language_level=3
"""GPU arena for clefcore's CUDA backend: one reservation at load, sub-allocated for the engine's lifetime.

``Arena(nbytes, device_id)`` reserves one block of device memory (a single cudaMalloc through CuPy). Between
``activate()`` and ``deactivate()`` (``CudaOps.begin_forward`` / ``end_forward``) every CuPy allocation of the
current thread is carved out of it, best fit and 256-byte aligned, and its range goes back to the arena when
the array dies. So a forward never calls cudaMalloc, and the token-blocked prefill's early frees are reused
by the next block. Running out raises ``clefcore.errors.ArenaFull`` (a DeviceError) naming the bytes asked
for, the largest free piece and the free total; an arena made with ``overflow=True`` instead takes that
allocation from CuPy's own pool and counts it (``overflows``, ``overflow_bytes``): work beyond what the arena was
sized for (an image batch) is answered, and the count says the reservation was short.

Ownership: the Arena owns the reservation (a ``cupy.cuda.Memory``). Each piece handed out is a
``cupy.cuda.MemoryPointer`` over ``UnownedMemory`` whose owner is a ``_Piece``; CuPy keeps the owner alive as
long as any array or view uses the memory, and the piece returns its range when it is collected. Reuse is
stream-ordered as in CuPy's own pool: the backend queues all its work on one stream, so a kernel that reuses
a range runs after every kernel that read the range's previous contents.

``FreeList`` is the bookkeeping alone (integers, no device), so it is tested without a GPU.
"""

from bisect import bisect_left

cimport cython
import cupy

from clefcore.errors import ArenaFull, DeviceError

DEF ALIGN = 256


# Not tracked by the collector: it holds two lists of integers and so can never be part of a cycle. Were it
# tracked, a collection could clear its lists (tp_clear) while a dying _Piece still has a range to give back.
@cython.no_gc
cdef class FreeList:
    """Free ranges [start, start + size) of a capacity, sorted by start and coalesced; best-fit ``take``."""

    cdef readonly unsigned long long capacity
    cdef readonly unsigned long long in_use
    cdef readonly unsigned long long high_water
    cdef readonly unsigned long long extent      # the highest end of any range handed out: what a run touched
    cdef list _starts
    cdef list _sizes

    def __cinit__(self, unsigned long long capacity):
        self.capacity = capacity
        self._starts = [0] if capacity else []
        self._sizes = [capacity] if capacity else []
        self.in_use = 0
        self.high_water = 0
        self.extent = 0

    cpdef long long take(self, unsigned long long size):
        """The start of a free range of ``size`` bytes, now in use; -1 when no free range is large enough."""
        cdef Py_ssize_t i, best = -1
        cdef unsigned long long s, best_size = 0
        for i in range(len(self._sizes)):
            s = self._sizes[i]
            if s >= size and (best < 0 or s < best_size):
                best, best_size = i, s
                if s == size:
                    break
        if best < 0:
            return -1
        start = self._starts[best]
        if best_size == size:
            del self._starts[best]
            del self._sizes[best]
        else:
            self._starts[best] = start + size
            self._sizes[best] = best_size - size
        self.in_use += size
        if self.in_use > self.high_water:
            self.high_water = self.in_use
        if start + size > self.extent:
            self.extent = start + size
        return start

    cpdef give(self, unsigned long long start, unsigned long long size):
        """Return [start, start + size); merges with its free neighbours. Overlapping a free range (a double
        free) or leaving the capacity is an error: the arena would hand the same bytes out twice."""
        cdef Py_ssize_t i = bisect_left(self._starts, start)
        if start + size > self.capacity or size > self.in_use:
            raise ValueError(f"free of [{start}, {start + size}) outside the {self.capacity}-byte arena's use")
        if (i > 0 and self._starts[i - 1] + self._sizes[i - 1] > start) or \
                (i < len(self._starts) and start + size > self._starts[i]):
            raise ValueError(f"double free of [{start}, {start + size})")
        self.in_use -= size
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == start:
            i -= 1
            start = self._starts[i]
            size += self._sizes[i]
            del self._starts[i]
            del self._sizes[i]
        if i < len(self._starts) and start + size == self._starts[i]:
            size += self._sizes[i]
            del self._starts[i]
            del self._sizes[i]
        self._starts.insert(i, start)
        self._sizes.insert(i, size)

    def largest_free(self):
        return max(self._sizes, default=0)

    def ranges(self):
        """Free ranges as (start, size) pairs, by start."""
        return list(zip(self._starts, self._sizes))


cdef class _Piece:
    """Owner of one handed-out range: returns it to the arena when CuPy drops the memory."""

    cdef Arena arena
    cdef unsigned long long start
    cdef unsigned long long size

    def __dealloc__(self):
        if self.arena is not None:
            self.arena.free.give(self.start, self.size)


# When an arena dies in a reference cycle (an engine that holds it and arrays cut from it), the collector
# clears the cycle's objects in no set order. Clearing the arena's ``free`` first made the next _Piece to die
# call give() on None: a segfault inside gc (seen in the full GPU suite). So the arena keeps its fields until
# its own dealloc, which cannot come before its last piece's (each piece holds a reference).
@cython.no_gc_clear
cdef class Arena:
    cdef readonly FreeList free
    cdef readonly unsigned long long base
    cdef readonly int device_id
    cdef readonly bint overflow
    cdef readonly unsigned long long overflows
    cdef readonly unsigned long long overflow_bytes
    cdef object _mem
    cdef object _ctx

    def __cinit__(self, unsigned long long nbytes, int device_id=0, bint overflow=False):
        self.device_id = device_id
        self.overflow = overflow
        self.overflows = 0
        self.overflow_bytes = 0
        with cupy.cuda.Device(device_id):
            try:
                self._mem = cupy.cuda.Memory(nbytes)
            except cupy.cuda.memory.OutOfMemoryError:
                free, total = cupy.cuda.runtime.memGetInfo()
                raise DeviceError(f"arena: cannot reserve {nbytes} bytes on GPU {device_id} "
                                  f"({free} of {total} bytes free)") from None
        self.base = <unsigned long long>self._mem.ptr
        self.free = FreeList(nbytes)
        self._ctx = None

    @property
    def capacity(self):
        return self.free.capacity

    @property
    def in_use(self):
        return self.free.in_use

    @property
    def high_water(self):
        return self.free.high_water

    @property
    def extent(self):
        """Bytes from the arena's start to the end of the highest range ever handed out: an arena of this
        capacity (plus fragmentation's margin, see clefcore.backends.cuda.reserve) holds the same run."""
        return self.free.extent

    cpdef object alloc(self, unsigned long long nbytes):
        """A MemoryPointer to ``nbytes`` (rounded up to 256) inside the arena."""
        cdef unsigned long long size = max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
        cdef long long start = self.free.take(size)
        if start < 0 and self.overflow:
            self.overflows += 1
            self.overflow_bytes += nbytes
            with cupy.cuda.Device(self.device_id):
                return cupy.get_default_memory_pool().malloc(nbytes)
        if start < 0:
            raise ArenaFull(f"arena out of memory: asked for {nbytes} bytes; largest free piece "
                            f"{self.free.largest_free()} bytes, {self.free.capacity - self.free.in_use} of "
                            f"{self.free.capacity} bytes free (lower the token block or the batch's tokens)")
        piece = _Piece()
        piece.arena, piece.start, piece.size = self, start, size
        mem = cupy.cuda.UnownedMemory(self.base + start, size, piece, self.device_id)
        return cupy.cuda.MemoryPointer(mem, 0)

    def malloc(self, nbytes):
        """CuPy allocator protocol."""
        return self.alloc(nbytes)

    def total_bytes(self):
        """As CuPy's MemoryPool says it: the device bytes held, here the whole reservation."""
        return self.free.capacity

    def activate(self):
        """Route this thread's CuPy allocations into the arena until ``deactivate()``."""
        if self._ctx is None:
            self._ctx = cupy.cuda.using_allocator(self.malloc)
            self._ctx.__enter__()

    def deactivate(self):
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(None, None, None)

    def __repr__(self):
        return (f"Arena(device={self.device_id}, capacity={self.capacity}, in_use={self.in_use}, "
                f"high_water={self.high_water}, overflows={self.overflows})")
