"""The asyncio side of batching: futures, deadlines, disconnects, and the one thread that talks to the
device.

Requests are queued in the Cython scheduler (``clefcore.scheduler``); a single dispatcher task takes the
next packed batch whenever the device is free and runs ``engine.infer`` on the device thread, so the
event loop never waits on the model. Batching is continuous: whatever queued up while one forward ran is
packed into the next one, so under load batches grow by themselves and an idle server adds no delay.

A device failure of a packed batch is retried request by request: only the request(s) that fail alone
get a 500, the rest of the batch is answered normally.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from clefcore.errors import DeviceError
from clefcore.scheduler import Entry, Scheduler

from .device_thread import DeviceThread
from .metrics import Metrics
from .testhooks import TestHooks


class QueueFull(Exception):
    pass


class DeadlineExceeded(Exception):
    pass


@dataclass
class Outcome:
    """A request's answer plus what the request log line and the metrics want to know about its trip."""
    response: dict
    queue_wait_s: float
    prefill_s: float
    batch_requests: int
    batch_tokens: int


class Batcher:
    def __init__(self, engine: Any, device: DeviceThread, metrics: Metrics, *, max_queue: int,
                 max_batch_tokens: int, max_batch_requests: int, hooks: TestHooks):
        self._engine = engine
        self._metrics = metrics
        self._scheduler = Scheduler(max_queue)
        self._max_tokens = max_batch_tokens
        self._max_requests = max_batch_requests
        self._device = device
        self._wake = asyncio.Event()
        self._running: list = []  # entries of the batch on the device now
        self._task: asyncio.Task | None = None
        self._hooks = hooks

    @property
    def capacity(self) -> int:
        return self._scheduler.capacity

    @property
    def queued(self) -> int:
        return len(self._scheduler)

    def full(self) -> bool:
        return self._scheduler.full()

    def idle(self) -> bool:
        return len(self._scheduler) == 0 and not self._running

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._dispatch(), name="clef-dispatch")

    async def stop(self) -> None:
        """The drain timeout has passed: answer everything still queued or on the device with a timeout
        (so no accepted request is cut off without an answer) and stop the dispatcher."""
        for entry in self._scheduler.drain() + self._running:
            _, future = entry.payload
            if not future.done():
                future.set_exception(DeadlineExceeded())
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def submit(self, prepared: Any, deadline: float) -> Outcome:
        """Queue one prepared request and wait for its answer. Raises QueueFull at once when there is no
        room, DeadlineExceeded when ``deadline`` (time.monotonic) passes first, or the device's error."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        now = time.monotonic()
        entry = Entry((prepared, future), prepared.num_tokens, deadline, now)
        if not self._scheduler.push(entry):
            raise QueueFull()
        self._metrics.queue_depth.set(len(self._scheduler))
        self._wake.set()
        try:
            return await asyncio.wait_for(future, timeout=max(deadline - now, 0.0))
        except asyncio.TimeoutError:
            self._scheduler.cancel(entry)
            raise DeadlineExceeded() from None
        except asyncio.CancelledError:
            # The client went away (aiohttp cancels the handler): give the slot back; if the request is
            # already on the device its result is simply dropped.
            if entry.queued:
                self._metrics.cancelled.inc()
            self._scheduler.cancel(entry)
            raise
        finally:
            self._metrics.queue_depth.set(len(self._scheduler))

    async def _dispatch(self) -> None:
        while True:
            if len(self._scheduler) == 0:
                self._wake.clear()
                await self._wake.wait()
            batch = self._scheduler.take(self._max_tokens, self._max_requests, time.monotonic())
            self._metrics.queue_depth.set(len(self._scheduler))
            for entry in batch.expired:
                self._metrics.expired.inc()
                _, future = entry.payload
                if not future.done():
                    future.set_exception(DeadlineExceeded())
            if not batch.entries:
                continue
            started = time.monotonic()
            prepared = [entry.payload[0] for entry in batch.entries]
            self._running = batch.entries
            self._metrics.running.set(len(prepared))
            try:
                results, prefill_s = await self._device.run(self._run_on_device, prepared)
            finally:
                self._running = []
                self._metrics.running.set(0)
            self._metrics.batches.inc()
            self._metrics.after_batch(self._engine)
            self._metrics.batch_requests.observe(len(prepared))
            self._metrics.batch_tokens.observe(batch.tokens)
            self._metrics.prefill.observe(prefill_s)
            for entry, (response, error) in zip(batch.entries, results):
                _, future = entry.payload
                wait_s = started - entry.enqueued_at
                self._metrics.queue_wait.observe(wait_s)
                if future.done():  # the client left while its request was on the device
                    continue
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(Outcome(response, wait_s, prefill_s, len(prepared), batch.tokens))

    def _run_on_device(self, prepared: list) -> tuple[list[tuple[dict | None, Exception | None]], float]:
        """Device thread. Returns one (response, error) pair per request and the forward's duration."""
        started = time.perf_counter()
        try:
            results = [(response, None) for response in self._infer(prepared)]
        except Exception as batch_error:  # noqa: BLE001 - any device failure is isolated below
            if len(prepared) == 1:
                results = [(None, _as_device_error(batch_error))]
            else:
                results = []
                for one in prepared:
                    try:
                        results.append((self._infer([one])[0], None))
                    except Exception as error:  # noqa: BLE001
                        results.append((None, _as_device_error(error)))
        return results, time.perf_counter() - started

    def _infer(self, prepared: list) -> list[dict]:
        hooks = self._hooks
        if hooks.batch_delay_s:
            time.sleep(hooks.batch_delay_s)
        if hooks.fail_marker is not None:
            for p in prepared:
                state = p.request.get("state")
                if isinstance(state, str) and hooks.fail_marker in state:
                    raise DeviceError("injected device fault (test hook)")
        return self._engine.infer(prepared)


def _as_device_error(error: Exception) -> DeviceError:
    return error if isinstance(error, DeviceError) else DeviceError(f"{type(error).__name__}: {error}")
