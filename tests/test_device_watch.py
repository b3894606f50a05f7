"""Stalls and faults (server/device_watch.py), and the batcher's side of them (server/batcher.py): a call past its
limit is a stall found once and ended by the call's end, a trouble that outlasts the grace is given up once, a
failed self-check is a fault counted once however often it is checked again, and a device that fails a request
but passes its self-check is no trouble at all. On a real event loop, with limits of a fraction of a second."""

from __future__ import annotations

import asyncio
import time

import pytest

from clefcore.errors import DeviceError
from clefcore.server import batcher as batcher_module
from clefcore.server.admission import Budgets
from clefcore.server.batcher import Batcher, DeviceUnavailable
from clefcore.server.device_watch import STALL_FACTOR, DeviceWatch
from clefcore.server.metrics import Metrics
from server_harness import FAKE_STATUS, Prepared


class Seen:
    """What the watch told its owner, each with the time it came, and an event per kind."""

    def __init__(self):
        self.changes: list[tuple[float, object]] = []
        self.expired: list[tuple[float, object]] = []
        self.changed = asyncio.Event()
        self.gave_up = asyncio.Event()

    def change(self, trouble):
        self.changes.append((time.monotonic(), trouble))
        self.changed.set()

    def expire(self, trouble):
        self.expired.append((time.monotonic(), trouble))
        self.gave_up.set()


def watch(metrics: Metrics, seen: Seen, stall_s: float, grace_s: float) -> DeviceWatch:
    return DeviceWatch(metrics, stall_s, grace_s, on_change=seen.change, on_expired=seen.expire)


def value(metrics: Metrics, name: str, labels: dict | None = None) -> float:
    return metrics.registry.get_sample_value(name, labels or {})


def test_the_limit_is_the_floor_or_a_multiple_of_the_expected_time():
    w = DeviceWatch(Metrics(), 30.0, 60.0, on_change=print, on_expired=print)
    assert w.limit_s(1_000, 10_000.0) == 30.0                                 # 0.1 s expected: the floor
    assert w.limit_s(400_000, 10_000.0) == pytest.approx(STALL_FACTOR * 40.0)  # 40 s expected


def test_a_call_within_its_limit_is_no_trouble_and_one_past_it_is_a_stall_until_it_ends():
    metrics, seen = Metrics(), Seen()

    async def main():
        w = watch(metrics, seen, stall_s=0.2, grace_s=30.0)
        w.started("0", "forward", 100, 1e6)
        await asyncio.sleep(0.05)
        w.ended("0")                                  # in time
        await asyncio.sleep(0.3)                      # past where its limit was: nothing fires
        assert seen.changes == [] and w.trouble is None
        started = time.monotonic()
        w.started("0", "forward", 100, 1e6)
        await seen.changed.wait()
        at, trouble = seen.changes[0]
        assert at - started >= 0.2 and trouble is w.trouble
        assert (trouble.lane, trouble.kind) == ("0", "stalled")
        assert trouble.reason == "stalled: device 0's forward of 100 tokens has run past its 0.2 s limit"
        stalled = value(metrics, "clef_device_stalled")
        seen.changed.clear()
        w.ended("0")
        assert seen.changes[-1][1] is None and w.trouble is None
        w.close()
        return stalled

    assert asyncio.run(main()) == 1
    assert len(seen.changes) == 2 and seen.expired == []
    assert value(metrics, "clef_device_stalled") == 0
    assert value(metrics, "clef_device_faults_total", {"kind": "stall"}) == 1
    assert value(metrics, "clef_device_faults_total", {"kind": "self_check"}) == 0


def test_a_stall_past_the_grace_is_given_up_once_and_its_end_is_no_recovery():
    metrics, seen = Metrics(), Seen()

    async def main():
        w = watch(metrics, seen, stall_s=0.1, grace_s=0.3)
        w.started("1", "chunk step", 4096, 1e6)
        await seen.gave_up.wait()
        w.ended("1")          # the killed process's call comes back failed
        await asyncio.sleep(0.1)
        trouble = w.trouble
        w.close()
        return trouble

    trouble = asyncio.run(main())
    (found_at, found), = seen.changes          # found once; its end after the give-up changes nothing
    (expired_at, expired), = seen.expired
    assert expired is found and trouble is found and expired_at - found_at >= 0.3
    assert value(metrics, "clef_device_stalled") == 0   # no call is running past its limit any more


def test_a_fault_is_counted_once_while_it_lasts_and_a_passed_check_ends_it():
    metrics, seen = Metrics(), Seen()

    async def main():
        w = watch(metrics, seen, stall_s=30.0, grace_s=30.0)
        w.checked("0")                                 # a passed check with nothing found: nothing happens
        w.faulted("0", "DeviceError: an illegal memory access")
        w.faulted("0", "DeviceError: an illegal memory access")   # checked again, failed again
        trouble = w.trouble
        w.checked("0")
        w.close()
        return trouble

    trouble = asyncio.run(main())
    assert trouble.kind == "faulted" and "illegal memory access" in trouble.reason
    assert [t for _, t in seen.changes] == [trouble, None]
    assert value(metrics, "clef_device_faults_total", {"kind": "self_check"}) == 1


# --- the batcher's side -----------------------------------------------------------------------------------------

class FlakyDevice:
    """A device process without a process: ``poison`` fails the request that carries it; the self-check fails
    ``bad_checks`` times before it passes (a device that is faulted for a while)."""

    def __init__(self, bad_checks: int):
        self.status = FAKE_STATUS
        self.lost = None
        self.bad_checks = bad_checks
        self.checks = 0

    async def infer(self, prepared):
        await asyncio.sleep(0.02)
        return [(None, DeviceError("boom")) if p.poison else ({"prompt": p.name}, None) for p in prepared], 0.02

    async def self_check(self):
        self.checks += 1
        await asyncio.sleep(0.01)
        if self.checks <= self.bad_checks:
            raise DeviceError("every call fails")


def run_batcher(device: FlakyDevice) -> tuple[list, list, Metrics]:
    """Submit a poisoned request (alone on the device) and three sound ones queued behind it, then, once the
    device is out of trouble, one more; the outcomes, the watch's changes and the metrics."""
    requests = [Prepared(num_tokens=10, name="bad", poison=True)] + [
        Prepared(num_tokens=10, name=f"q{i}", poison=False) for i in range(3)]
    metrics, changes = Metrics(), []
    recovered = asyncio.Event()

    async def main():
        b: Batcher

        def change(trouble):
            changes.append(trouble)
            if trouble is not None:
                b.refuse_queued(trouble.reason)      # as the Service does
            else:
                recovered.set()

        w = DeviceWatch(metrics, 30.0, 30.0, on_change=change, on_expired=lambda trouble: None)
        b = Batcher([device], metrics, watch=w, max_queue=64, max_batch_tokens=100, max_batch_requests=1,
                    budgets=Budgets(100.0, 100.0, 10_000), start_rate=10_000.0, chunk_tokens=0)
        b.start()
        deadline = time.monotonic() + 30
        first = asyncio.ensure_future(b.submit(requests[0], deadline))
        await asyncio.sleep(0.005)                       # on the device now
        rest = [asyncio.ensure_future(b.submit(r, deadline)) for r in requests[1:]]
        outcomes = await asyncio.gather(first, *rest, return_exceptions=True)
        if changes:
            await asyncio.wait_for(recovered.wait(), 5)
        outcomes.append(await b.submit(Prepared(num_tokens=10, name="after", poison=False), deadline))
        await b.stop()
        w.close()
        return outcomes

    return asyncio.run(main()), changes, metrics


def test_a_request_that_fails_on_a_sound_device_fails_alone():
    device = FlakyDevice(bad_checks=0)
    outcomes, changes, metrics = run_batcher(device)
    assert isinstance(outcomes[0], DeviceError)
    assert [o.response["prompt"] for o in outcomes[1:]] == ["q0", "q1", "q2", "after"]
    assert device.checks == 1 and changes == []
    assert value(metrics, "clef_device_faults_total", {"kind": "self_check"}) == 0


def test_a_faulted_device_refuses_the_queue_at_once_and_serves_again_once_its_check_passes(monkeypatch):
    monkeypatch.setattr(batcher_module, "RECHECK_S", 0.05)
    device = FlakyDevice(bad_checks=3)
    outcomes, changes, metrics = run_batcher(device)
    assert isinstance(outcomes[0], DeviceError)                      # it ran on the device: 500
    assert all(isinstance(o, DeviceUnavailable) for o in outcomes[1:4]), outcomes   # queued: 503
    assert outcomes[4].response == {"prompt": "after"}
    assert device.checks == 4                                         # three failed, the fourth passed
    assert [t.kind if t else None for t in changes] == ["faulted", None]
    assert value(metrics, "clef_device_faults_total", {"kind": "self_check"}) == 1
