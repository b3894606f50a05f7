"""The turn of a body on the prepare threads (validation, image decoding, tokenization): the smallest first, with
aging.

The thread pool itself is first come, first served. Under load its queue fills with long states, and a short
decision that arrives behind them waits for all of them before it is even tokenized, then perhaps only to be
told 429. So at most ``slots`` bodies are handed to the pool at once, and the rest wait here in the order of
their turn: arrival time plus size over ``bytes_per_s``. A body that arrives later goes first only while it is
smaller by what the threads prepare in the meantime, so a large one is delayed, never starved.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from concurrent.futures import Executor
from typing import Any, Callable

# Turn per byte: ~1 MB/s is a prepare thread's pace on a long state (tokenizing dominates), so a 100 KB body
# yields to smaller ones for about the 0.1 s that it takes itself.
BYTES_PER_S = 1_000_000.0


class PrepareGate:
    def __init__(self, slots: int, bytes_per_s: float = BYTES_PER_S, clock: Callable[[], float] = time.monotonic,
                 on_wait: Callable[[float], None] | None = None):
        if slots < 1 or not bytes_per_s > 0:
            raise ValueError(f"prepare gate: slots {slots} must be >= 1 and bytes_per_s {bytes_per_s} > 0")
        self._free = slots
        self._rate = float(bytes_per_s)
        self._clock = clock
        self._waiting: list = []          # heap of (turn, arrival order, future)
        self._order = itertools.count()
        self._on_wait = on_wait           # called with each body's wait in seconds (a metric)

    @property
    def waiting(self) -> int:
        return sum(1 for *_, f in self._waiting if not f.done())

    async def run(self, nbytes: int, fn: Callable[[], Any], executor: Executor) -> Any:
        """``fn()`` on ``executor`` once this body's turn comes."""
        start = self._clock()
        await self._acquire(nbytes)
        if self._on_wait is not None:
            self._on_wait(self._clock() - start)
        try:
            work = asyncio.get_running_loop().run_in_executor(executor, fn)
        except BaseException:             # a pool already shut down: the slot goes back at once
            self._release()
            raise
        # the slot is the thread's until fn returns, even when the client leaves meanwhile (the shield keeps a
        # cancelled caller from cancelling the future, whose callback then gives the slot back on time)
        work.add_done_callback(self._finished)
        return await asyncio.shield(work)

    def _finished(self, work: asyncio.Future) -> None:
        if not work.cancelled():
            work.exception()              # read it: asyncio would log an error no one awaited (a caller left)
        self._release()

    async def _acquire(self, nbytes: int) -> None:
        # a free slot means no one is waiting for it (a release hands its slot to the first live waiter), although
        # the heap may still hold the entries of waiters that left
        if self._free > 0:
            self._free -= 1
            return
        turn = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (self._clock() + max(0, nbytes) / self._rate, next(self._order), turn))
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():   # the slot came just as the client left: pass it on
                self._release()
            raise                                      # otherwise its heap entry is skipped when popped

    def _release(self) -> None:
        while self._waiting:
            *_, turn = heapq.heappop(self._waiting)
            if not turn.done():
                turn.set_result(None)
                return
        self._free += 1
