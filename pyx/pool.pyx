# cython: language_level=3
"""GPU arena for clefcore's CUDA backend: one reservation at load, bump allocation per forward.

``Arena(nbytes, device_id)`` reserves one block of device memory (a single cudaMalloc through CuPy) sized for
the configured token budget. ``alloc(nbytes)`` hands out 256-byte-aligned pieces of it; nothing is freed
piece by piece: ``reset()`` at the start of each forward makes the whole arena available again, so a request
never calls cudaMalloc. Running out raises ``clefcore.errors.DeviceError`` naming the bytes asked for and the
bytes left. ``activate()`` / ``deactivate()`` route every CuPy allocation of the current thread to the arena
(``cupy.cuda.using_allocator``), which is how ``CudaOps.begin_forward`` / ``end_forward`` use it: arrays made
by the ops during one forward live in the arena and die with the next ``reset()``; anything that must outlive
the forward is copied out (answers go to the host anyway).

Ownership: the Arena owns the reservation (a ``cupy.cuda.Memory``); every pointer it hands out is a
``cupy.cuda.MemoryPointer`` over ``UnownedMemory`` whose owner is the Arena, so the reservation lives as long
as any array made from it.
"""

from libc.stdint cimport uint64_t

import cupy

from clefcore.errors import DeviceError

DEF ALIGN = 256


cdef class Arena:
    cdef readonly uint64_t capacity
    cdef readonly uint64_t offset
    cdef readonly uint64_t high_water
    cdef readonly uint64_t base
    cdef readonly int device_id
    cdef readonly bint fallback
    cdef readonly uint64_t fallback_bytes
    cdef object _mem
    cdef object _ctx

    def __cinit__(self, uint64_t nbytes, int device_id=0, bint fallback=False):
        self.device_id = device_id
        with cupy.cuda.Device(device_id):
            try:
                self._mem = cupy.cuda.Memory(nbytes)
            except cupy.cuda.memory.OutOfMemoryError:
                free, total = cupy.cuda.runtime.memGetInfo()
                raise DeviceError(f"arena: cannot reserve {nbytes} bytes on GPU {device_id} "
                                  f"({free} of {total} bytes free)") from None
        self.base = <uint64_t>self._mem.ptr
        self.capacity = nbytes
        self.offset = 0
        self.high_water = 0
        self.fallback = fallback
        self.fallback_bytes = 0
        self._ctx = None

    cpdef uint64_t bytes_left(self):
        return self.capacity - self.offset

    cpdef reset(self):
        """Make the whole arena available again (start of a forward)."""
        self.offset = 0
        self.fallback_bytes = 0

    cpdef object alloc(self, uint64_t nbytes):
        """A MemoryPointer to ``nbytes`` (rounded up to 256) inside the arena."""
        cdef uint64_t size = (nbytes + ALIGN - 1) // ALIGN * ALIGN
        if size == 0:
            size = ALIGN
        if size > self.capacity - self.offset:
            if self.fallback:
                self.fallback_bytes += size
                return cupy.cuda.alloc(size)
            raise DeviceError(f"arena out of memory: asked for {nbytes} bytes, {self.capacity - self.offset} "
                              f"of {self.capacity} bytes left (raise max_tokens or lower the request size)")
        cdef uint64_t ptr = self.base + self.offset
        self.offset += size
        if self.offset > self.high_water:
            self.high_water = self.offset
        mem = cupy.cuda.UnownedMemory(ptr, size, self, self.device_id)
        return cupy.cuda.MemoryPointer(mem, 0)

    def malloc(self, nbytes):
        """CuPy allocator protocol."""
        return self.alloc(nbytes)

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
        return (f"Arena(device={self.device_id}, capacity={self.capacity}, used={self.offset}, "
                f"high_water={self.high_water})")


def arena_bytes_for(int max_tokens, int hidden=4096, int intermediate=12288, int token_block=4096,
                    int conv_dim=8192, int heads_v=32, int dk=128, int dv=128, int gdn_block_chunks=128):
    """Arena size for a token budget with the current (unfused) CUDA backend: the live fp32 activations of
    one layer at ``max_tokens`` plus the token-blocked MLP and the GDN chunk workspace, with 25% headroom."""
    cdef uint64_t T = max_tokens
    cdef uint64_t per_token = 4 * (4 * hidden + 3 * conv_dim + 3 * heads_v * dv)   # x, h, sums, qkv/conv, q/k/v, z, o
    cdef uint64_t mlp = 4 * 3 * <uint64_t>min(max_tokens, token_block) * intermediate
    cdef uint64_t gdn = 4 * <uint64_t>gdn_block_chunks * heads_v * 64 * (dv + dk + 64 + 1)
    return int((T * per_token + mlp + gdn) * 5 // 4)
