"""The model behind the routes, as a library for asyncio programs: load, admission, batching, drain.

A ``Service`` owns the device processes (server/device_process.py: the engine in a process of its own, one per
device of ``ServiceConfig.device``; several share one queue, as the batcher's lanes), the
``Preparer`` with its thread pool and the gate in front of it (validation, images and tokenization, smallest
bodies first: server/prepare.py), the ``Batcher`` (admission, the scheduler, packed forwards and chunked
prefill: server/batcher.py), the ``Lifecycle`` (loading, ready, draining, failed) and the ``Metrics``. It knows
nothing of HTTP: the routes (server/routes.py) call it and map its typed errors to status codes, and any asyncio
program can do the same::

    service = Service(ServiceConfig(model="/path/to/model"))
    await service.start()                  # load, warm up, self-check; ready
    answer = await service.decide(body)    # concurrent calls share packed forwards
    await service.drain(30.0)              # answer what was accepted, refuse the rest
    await service.stop()

``decide`` raises ``clefcore.RequestError`` for a body the engine refuses (its ``field`` and ``limit``), and
otherwise only the ``ServiceError`` kinds below.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from clefcore.checkpoint import Checkpoint
from clefcore.engine import EngineStatus
from clefcore.errors import ClefError
from clefcore.options import ServiceConfig, backend_options
from clefcore.preparer import Preparer

from . import admission, gpus
from .admission import Budgets, Refusal
from .batcher import Batcher, DeadlineExceeded, Hold, QueueFull
from .device_process import DeviceProcess
from .engine_status import combined
from .lifecycle import DRAINING, FAILED, LOADING, READY, Lifecycle
from .logs import log
from .metrics import Metrics
from .prepare import PrepareGate
from .steps import StepSize
from .testhooks import TestHooks

__all__ = ["Service", "ServiceConfig", "ServiceError", "Unavailable", "Overloaded", "TimedOut",
           "InferenceFailed"]


@dataclass
class Arrival:
    """One request inside ``Service.accept``: what the arrival check holds for it until it is queued."""
    hold: Hold | None = None


class ServiceError(Exception):
    """A request the service did not answer, for a reason other than its body."""


class Unavailable(ServiceError):
    """Not taking requests: loading, draining or failed (``reason``); ask again after ``retry_after_s``."""

    def __init__(self, reason: str, retry_after_s: int):
        super().__init__(f"service is {reason}")
        self.reason = reason
        self.retry_after_s = retry_after_s


class Overloaded(ServiceError):
    """Not admitted, or displaced before it started (``refusal``: why, the expected wait and its budget, when to
    retry); ``capacity``: the queue's bound in requests."""

    def __init__(self, refusal: Refusal, capacity: int):
        super().__init__(refusal.reason)
        self.refusal = refusal
        self.capacity = capacity


class TimedOut(ServiceError):
    """The request waited ``timeout_s`` (the config's request_timeout) without an answer."""

    def __init__(self, timeout_s: float):
        super().__init__(f"no answer within {timeout_s:g} s")
        self.timeout_s = timeout_s


class InferenceFailed(ServiceError):
    """The device failed this request (``error``: the engine's ClefError); the others in its batch are answered."""

    def __init__(self, error: ClefError):
        super().__init__(str(error))
        self.error = error


class Service:
    def __init__(self, config: ServiceConfig):
        self.config = config
        self.lifecycle = Lifecycle()
        self.metrics = Metrics()
        self.hooks = TestHooks.from_environment()
        self.devices: list[DeviceProcess] = []
        self._loads_as: list[str] = []    # the device name each device process loads its engine on
        several = len(config.devices) > 1
        for i, device in enumerate(config.devices):
            # several: each device process sees only its own GPU, as cuda:0; one sees what the server sees
            with gpus.alone(device) if several else contextlib.nullcontext(device) as loads_as:
                self._loads_as.append(loads_as)
                self.devices.append(DeviceProcess(self.hooks, f"clef-device-{i}" if several else "clef-device"))
        self.metrics.devices.set(len(self.devices))
        self.preparer: Preparer | None = None   # both set once the model is loaded and self-checked
        self.batcher: Batcher | None = None
        self._loop_lag: asyncio.Task | None = None   # metrics.watch_loop_lag, from ready to stop
        # Validation + tokenization of incoming bodies; a pool so one long state does not hold up the rest, and a
        # gate in front of it that hands it the smallest bodies first (server/prepare.py).
        threads = max(2, min(4, os.cpu_count() or 2))
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="clef-prepare")
        self._gate = PrepareGate(threads, on_wait=self.metrics.prepare_wait.observe)

    @property
    def status(self) -> EngineStatus | None:
        """What the loaded engine runs as (model, device, precision, fallbacks; on several devices their
        engines' together, named as configured); None until it is loaded."""
        if self.preparer is None:
            return None
        return combined([device.status for device in self.devices], ",".join(self.config.devices))

    # --- start and stop -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the model in the device process, warm it up, self-check it and measure its rate (which sizes
        auto steps from the first request on), then take requests (``ready``). A failure is logged, leaves the
        service ``failed`` and is raised."""
        cfg = self.config
        started = time.monotonic()
        if self.hooks.load_delay_s:
            await asyncio.sleep(self.hooks.load_delay_s)
        try:
            engines = await asyncio.gather(*(device.load(dict(
                path=cfg.model, device=loads_as, max_length=cfg.context_length, confidence=cfg.confidence,
                validation=cfg.validation, images=not cfg.no_images, **backend_options(cfg)), cfg.reserve_limits)
                for device, loads_as in zip(self.devices, self._loads_as)))
            engine = engines[0]
            self.lifecycle.set(LOADING, "warming up, running the self-check and measuring the device's rate")
            await asyncio.gather(*(device.self_check() for device in self.devices))
            # at the step size the device kind's guessed rate gives (near the size the measurement then sets),
            # within the batches the memory was reserved for
            size = min(StepSize(None, cfg.step_budget).at(admission.start_rate(cfg.devices[0])),
                       cfg.reserve_limits["batch_tokens"])
            measured = await asyncio.gather(*(device.measure(size) for device in self.devices))
            # the host side of requests (validation, images, tokenizer) lives here, beside the event loop
            preparer = await asyncio.get_running_loop().run_in_executor(self.executor, lambda: Preparer(
                Checkpoint(cfg.model), cfg.context_length, cfg.validation, engine.images_refused))
        except Exception as error:
            self.lifecycle.set(FAILED, f"{type(error).__name__}: {error}")
            log("load_failed", level="error", error=str(error), error_type=type(error).__name__)
            raise
        for device in self.devices:
            device.on_lost = self._device_lost
        self.preparer = preparer
        self.batcher = Batcher(self.devices, self.metrics, max_queue=cfg.max_queue,
                               max_batch_tokens=cfg.max_batch_tokens, max_batch_requests=cfg.max_batch_requests,
                               budgets=Budgets(cfg.min_queue_wait, cfg.wait_budget, cfg.context_length),
                               start_rate=admission.measured_rate(measured), chunk_tokens=cfg.chunk_tokens,
                               step_budget=cfg.step_budget, age_rate=cfg.age_rate, first_lane=cfg.first_lane)
        self.metrics.watch_engine(self.status, self.batcher.lane_statuses())
        self.batcher.start()
        self._loop_lag = asyncio.get_running_loop().create_task(self.metrics.watch_loop_lag(), name="clef-loop-lag")
        self.lifecycle.set(READY, "ready")
        self.metrics.ready.set(1)
        log("ready", model=engine.model_name, device=self.status.device, load_s=round(time.monotonic() - started, 3),
            images=engine.images_refused or "answered", device_memory_bytes=self.status.memory_in_use,
            reserved_bytes=self.status.backend.get("reserved_bytes", 0), rate_tokens_per_s=round(self.batcher.rate),
            max_batch_tokens=self.batcher.batch_tokens, chunk_tokens=self.batcher.chunk_tokens)

    def _device_lost(self, reason: str) -> None:
        """A device process died: the service fails and asks to be stopped (``clefcore serve`` then exits
        non-zero and is restarted; on several devices, whole, as a pod missing a GPU should be)."""
        self.lifecycle.set(FAILED, reason)
        self.metrics.ready.set(0)
        log("device_lost", level="error", error=reason)
        self.lifecycle.stop_requested.set()

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests (Unavailable, "shutting down"), wait up to ``timeout_s`` for the accepted ones to
        be answered, then answer whatever is left with TimedOut. True when everything was answered in time (a
        failed service has nothing left to answer: False)."""
        lifecycle = self.lifecycle
        drained = lifecycle.phase != FAILED
        if drained:
            lifecycle.set(DRAINING, "shutting down")
        if self.batcher is not None:
            if drained:
                log("draining", queued=self.batcher.queued, in_flight=lifecycle.in_flight)
                drained = await lifecycle.wait_drained(self.batcher.idle, timeout_s)
                log("drained" if drained else "drain_timeout", in_flight=lifecycle.in_flight)
            await self.batcher.stop()
        self.metrics.ready.set(0)
        return drained

    async def stop(self) -> None:
        """End the device processes and the prepare threads (after ``drain``, or after a failed ``start``)."""
        if self.batcher is not None:
            await self.batcher.stop()
        if self._loop_lag is not None:
            self._loop_lag.cancel()
            await asyncio.gather(self._loop_lag, return_exceptions=True)
        self.metrics.ready.set(0)
        await asyncio.gather(*(device.stop() for device in self.devices))
        self.executor.shutdown(wait=False, cancel_futures=True)

    # --- requests -------------------------------------------------------------------------------------
    async def decide(self, body: Any) -> dict:
        """Answer one System One request (``body``: as parsed from JSON) with the response dict. Concurrent
        calls are queued and packed into shared forwards; a prompt over chunk_tokens runs in chunks between
        them. Raises RequestError for a body the engine refuses, Unavailable, Overloaded, TimedOut or
        InferenceFailed."""
        started = time.monotonic()
        with self.accept() as arrival:
            self.refuse_early(arrival, None)
            return await self.answer(body, arrival, route="library", started=started)

    @contextlib.contextmanager
    def accept(self) -> Iterator[Arrival]:
        """A request from its arrival to its answer: refused with Unavailable unless the service is ready, and
        counted in flight meanwhile, so that ``drain`` waits for it. ``refuse_early`` and ``answer`` run in
        it, with the Arrival it yields."""
        lifecycle = self.lifecycle
        if lifecycle.phase != READY:
            raise Unavailable(lifecycle.reason, retry_after_s=5 if lifecycle.phase == LOADING else 1)
        lifecycle.in_flight += 1
        arrival = Arrival()
        try:
            yield arrival
        finally:
            lifecycle.in_flight -= 1
            self.batcher.release(arrival.hold)   # a body given up before it was queued (bad, gone, failed)

    def refuse_early(self, arrival: Arrival, body_bytes: int | None) -> None:
        """Raise Overloaded, before the body is read and tokenized, when the queue is full or the work before a
        body of ``body_bytes`` (None: unknown) is over its budget: shedding load must be cheap. Otherwise the
        body's estimated size is held as work ahead of later arrivals until it is queued."""
        refusal = self.batcher.early_refusal(body_bytes)
        if refusal is not None:
            raise Overloaded(refusal, self.batcher.capacity)
        arrival.hold = self.batcher.hold(body_bytes)

    async def answer(self, body: Any, arrival: Arrival, *, route: str, started: float,
                     body_bytes: int | None = None, read_bytes: int = 0, trace: dict | None = None) -> dict:
        """Prepare ``body`` on the threads, queue it, wait for its forward (inside ``accept``). ``route``: the
        e2e latency histogram's label, measured from ``started`` (time.monotonic). ``body_bytes``: its size on
        the wire when known, which teaches the early refusal tokens per byte; ``read_bytes``: its decoded size,
        its turn on the threads. ``trace`` (the request's log line) gets its tokens and its trip through the
        batcher."""
        cfg = self.config
        trace = {} if trace is None else trace
        prepared = await self._gate.run(read_bytes, lambda: self.preparer.prepare(body, on_overflow=cfg.on_overflow),
                                        self.executor)
        trace["prompt_tokens"] = prepared.num_tokens
        batcher = self.batcher
        batcher.release(arrival.hold)   # submit counts it exactly from here, with no await in between
        batcher.sizer.observe(body_bytes, prepared.num_tokens)
        deadline = time.monotonic() + cfg.request_timeout
        try:
            outcome = await batcher.submit(prepared, deadline)
        except QueueFull as full:
            raise Overloaded(full.refusal, batcher.capacity) from None
        except DeadlineExceeded:
            raise TimedOut(cfg.request_timeout) from None
        except ClefError as error:
            raise InferenceFailed(error) from None
        metrics = self.metrics
        metrics.prompt_tokens.inc(prepared.num_tokens)
        metrics.prompt_tokens_hist.observe(prepared.num_tokens)
        metrics.e2e.labels(route).observe(time.monotonic() - started)
        trace.update(queue_ms=round(outcome.queue_wait_s * 1000, 2), prefill_ms=round(outcome.prefill_s * 1000, 2),
                   batch_requests=outcome.batch_requests, batch_tokens=outcome.batch_tokens)
        response = outcome.response
        # The engine echoes the request's `model`; strict clients (instructor-php) refuse an empty one.
        if not str(response.get("model", "")).strip():
            response["model"] = self.devices[0].status.model_name
        return response
