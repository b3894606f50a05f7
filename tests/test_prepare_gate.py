"""server/prepare.py: bodies reach the prepare threads smallest first with aging, never more than the slots at once,
and a client that leaves while waiting neither keeps nor loses a slot."""

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from clefcore.server.prepare import PrepareGate


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


async def _started(gate, pool, order, name, nbytes, release=None):
    def work():
        order.append(name)
        if release is not None:
            release.wait(5)
        return name
    return await gate.run(nbytes, work, pool)


async def _settle():
    for _ in range(20):
        await asyncio.sleep(0.005)


def _race(big, small, small_at):
    """The gate's one slot held by a first body; ``big`` bytes arrive at t = 0, ``small`` bytes at ``small_at``
    (1,000 bytes a second of turn): the order in which the pool runs the three."""
    async def main():
        clock, order, hold = Clock(), [], threading.Event()
        gate = PrepareGate(1, bytes_per_s=1000.0, clock=clock)
        with ThreadPoolExecutor(4) as pool:
            first = asyncio.create_task(_started(gate, pool, order, "first", 0, hold))
            await _settle()
            late = asyncio.create_task(_started(gate, pool, order, "big", big))
            await _settle()
            clock.t = small_at
            early = asyncio.create_task(_started(gate, pool, order, "small", small))
            await _settle()
            assert order == ["first"] and gate.waiting == 2        # one slot: the others wait in the gate
            hold.set()
            assert await asyncio.gather(first, late, early) == ["first", "big", "small"]
        return order
    return asyncio.run(main())


@pytest.mark.parametrize("big, small, small_at, order", [
    (100_000, 1_000, 1.0, ["first", "small", "big"]),     # smaller first: turns 100 s and 2 s
    (5_000, 10, 10.0, ["first", "big", "small"]),         # aging (an early large body): 5 s and 10.01 s
])
def test_smaller_bodies_go_first_with_aging_and_slots_bound_the_threads(big, small, small_at, order):
    assert _race(big, small, small_at) == order


def test_a_waiter_that_leaves_does_not_keep_its_slot():
    async def main():
        order, hold = [], threading.Event()
        gate = PrepareGate(1)
        with ThreadPoolExecutor(2) as pool:
            first = asyncio.create_task(_started(gate, pool, order, "first", 0, hold))
            await _settle()
            gone = asyncio.create_task(_started(gate, pool, order, "gone", 10))
            later = asyncio.create_task(_started(gate, pool, order, "later", 20))
            await _settle()
            gone.cancel()
            await _settle()
            hold.set()
            assert await later == "later" and await first == "first"
            with pytest.raises(asyncio.CancelledError):
                await gone
            # every slot is back: a new body starts at once
            assert await asyncio.wait_for(_started(gate, pool, order, "after", 0), 2) == "after"
        return order
    assert asyncio.run(main()) == ["first", "later", "after"]


def test_a_slot_handed_to_a_leaving_waiter_is_passed_on():
    async def main():
        gate = PrepareGate(1)
        await gate._acquire(0)                        # the one slot, held
        leaving = asyncio.create_task(gate._acquire(10))
        waiting = asyncio.create_task(gate._acquire(20))
        await _settle()
        gate._release()                               # hands the slot to `leaving` ...
        leaving.cancel()                              # ... which is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await leaving
        await asyncio.wait_for(waiting, 2)            # the slot went on to the next waiter
        gate._release()
        assert gate._free == 1 and gate.waiting == 0
    asyncio.run(main())


def test_a_client_that_leaves_mid_prepare_keeps_the_slot_until_its_thread_is_done():
    async def main():
        order, hold = [], threading.Event()
        gate = PrepareGate(1)
        with ThreadPoolExecutor(2) as pool:
            left = asyncio.create_task(_started(gate, pool, order, "left", 0, hold))
            await _settle()
            left.cancel()
            with pytest.raises(asyncio.CancelledError):
                await left
            after = asyncio.create_task(_started(gate, pool, order, "after", 0))
            await _settle()
            assert order == ["left"]          # its thread still works: the next body waits for the slot
            hold.set()
            assert await asyncio.wait_for(after, 2) == "after"
        return order
    assert asyncio.run(main()) == ["left", "after"]


def test_an_error_reaches_the_caller_and_frees_the_slot():
    async def main():
        gate = PrepareGate(1)

        def bad():
            raise ValueError("bad body")
        with ThreadPoolExecutor(1) as pool:
            with pytest.raises(ValueError, match="bad body"):
                await gate.run(10, bad, pool)
            assert await gate.run(10, lambda: "next", pool) == "next"
    asyncio.run(main())


def test_a_pool_that_is_shut_down_gives_the_slot_back():
    async def main():
        gate = PrepareGate(1)
        pool = ThreadPoolExecutor(1)
        pool.shutdown()
        with pytest.raises(RuntimeError):
            await gate.run(10, lambda: "never", pool)
        assert gate._free == 1
    asyncio.run(main())


def test_each_wait_is_reported():
    async def main():
        clock, waits, hold = Clock(), [], threading.Event()
        gate = PrepareGate(1, clock=clock, on_wait=waits.append)
        with ThreadPoolExecutor(2) as pool:
            first = asyncio.create_task(_started(gate, pool, [], "first", 0, hold))
            await _settle()
            second = asyncio.create_task(_started(gate, pool, [], "second", 0))
            await _settle()
            clock.t = 3.0
            hold.set()
            await asyncio.gather(first, second)
        return waits
    assert asyncio.run(main()) == [0.0, 3.0]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="slots 0"):
        PrepareGate(0)
    with pytest.raises(ValueError, match="bytes_per_s"):
        PrepareGate(2, bytes_per_s=0)
