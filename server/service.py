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

``health()`` says what ``/health`` and ``/live`` answer: ready only once started and while every device answers
(server/device_watch.py: a stalled or faulted device makes the service unavailable, and its queued requests are
refused at once); alive until the service has failed (a failed start, a lost device process, or a device that
stayed stalled or faulted past ``device_grace``), when it asks to be stopped (``lifecycle.stop_requested``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from clefcore import hub
from clefcore.checkpoint import Checkpoint
from clefcore.engine import EngineStatus, padded
from clefcore.example_request import support_ticket
from clefcore.errors import ClefError, PromptTokensError
from clefcore.options import ServiceConfig
from clefcore.preparer import ImageLimits, Prepared, Preparer, pixel_bounds

from . import admission, gpus
from .admission import Budgets, Hold, Refusal, Refused
from .batcher import Batcher, DeadlineExceeded, DeviceUnavailable
from .device_process import DeviceProcess
from .device_watch import FAULTED, STALLED, DeviceWatch, Trouble
from .engine_status import combined
from .image_cost import TOWER_SIDES, TowerCost, image_limits
from .lifecycle import DRAINING, FAILED, LOADING, READY, Lifecycle
from .logs import log
from .metrics import Metrics
from .prepare import PrepareGate
from .prompt_cost import CONTEXT_CHUNKS, PROMPT_RUNS, PromptCost, PromptLimit
from .steps import StepSize
from .testhooks import TestHooks

__all__ = ["Service", "ServiceConfig", "ServiceError", "Unavailable", "Overloaded", "TimedOut",
           "InferenceFailed", "Health"]

T = TypeVar("T")

# Retry-After of the 503s while loading, or while a device is stalled, faulted or lost: it may take a while, and
# another replica may answer meanwhile. A draining server's clients should go elsewhere at once.
RETRY_AFTER_S = 5


@dataclass(frozen=True)
class Health:
    """What ``/health`` (``ready``) and ``/live`` (``live``) answer: ``status`` is ok, loading, draining, failed,
    stalled or faulted, ``reason`` says more, and a request refused now is told to retry after
    ``retry_after_s``."""
    ready: bool
    live: bool
    status: str
    reason: str
    retry_after_s: int


@dataclass
class Arrival:
    """One request inside ``Service.accept``: what the arrival check holds for it until it is queued."""
    hold: Hold | None = None


class ServiceError(Exception):
    """A request the service did not answer, for a reason other than its body."""


class Unavailable(ServiceError):
    """Not taking requests: loading, draining, failed, or a device stalled or faulted (``reason``); or refused
    while queued because of the device; ask again after ``retry_after_s``."""

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
        self.watch = DeviceWatch(self.metrics, config.stall_timeout, config.device_grace,
                                 on_change=self._device_trouble, on_expired=self._device_expired)
        self.preparer: Preparer | None = None   # all three set once the model is loaded and self-checked
        self.batcher: Batcher | None = None
        self.prompt_limit: PromptLimit | None = None
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
        loop = asyncio.get_running_loop()
        try:
            # A Hub id is pinned to the commit its ref names now: every device process and the preparer read the
            # same files, whatever a download does to the cache's refs meanwhile.
            where = await loop.run_in_executor(self.executor, hub.locate, cfg.model, cfg.revision)
            engines = await asyncio.gather(*(device.load(cfg.model, where.commit, loads_as, cfg.engine,
                                                         cfg.reserve_limits)
                                             for device, loads_as in zip(self.devices, self._loads_as)))
            engine = engines[0]
            self.lifecycle.set(LOADING, "warming up, running the self-check and measuring the device's rate")
            await asyncio.gather(*(device.self_check() for device in self.devices))
            # at the step size the device kind's guessed rate gives (near the size the measurement then sets),
            # within the batches the memory was reserved for
            size = min(StepSize(None, cfg.step_budget).at(admission.start_rate(cfg.devices[0])),
                       cfg.reserve_limits["batch_tokens"])
            measured = await asyncio.gather(*(device.measure(size) for device in self.devices))
            rate = admission.measured_rate(measured)
            towers = await asyncio.gather(*(device.measure_tower(TOWER_SIDES) for device in self.devices))
            samples = _mean_samples(towers)
            tower, tower_ceiling = TowerCost.fit(samples, rate), TowerCost.ceiling(samples, rate)
            # the host side of requests (validation, images, tokenizer) lives here, beside the event loop
            preparer = await loop.run_in_executor(self.executor, _preparer, cfg, where.commit, engine.images_refused,
                                                  tower, rate)
            self.prompt_limit = await self._measure_prompts(preparer, rate)
        except Exception as error:
            self.lifecycle.set(FAILED, f"{type(error).__name__}: {error}")
            log("load_failed", level="error", error=str(error), error_type=type(error).__name__)
            raise
        for device in self.devices:
            device.on_lost = self._device_lost
        self.preparer = preparer
        self.batcher = Batcher(self.devices, self.metrics, watch=self.watch, max_queue=cfg.max_queue,
                               max_batch_tokens=cfg.max_batch_tokens, max_batch_requests=cfg.max_batch_requests,
                               budgets=Budgets(cfg.min_wait_budget, cfg.wait_budget, cfg.engine.context_length),
                               start_rate=rate, chunk_tokens=cfg.chunk_tokens,
                               step_budget=cfg.step_budget, age_rate=cfg.age_rate, first_lane=cfg.first_lane,
                               policy=cfg.admission, tower=tower, tower_ceiling=tower_ceiling,
                               prompt_limit=self.prompt_limit)
        self.metrics.watch_engine(self.status, self.batcher.lane_statuses())
        self.batcher.start()
        self._loop_lag = asyncio.get_running_loop().create_task(self.metrics.watch_loop_lag(), name="clef-loop-lag")
        self.lifecycle.set(READY, "ready")
        self._publish_ready()
        log("ready", model=engine.model_name, model_path=str(where.path), device=self.status.device,
            load_s=round(time.monotonic() - started, 3), images=engine.images_refused or "answered",
            device_memory_bytes=self.status.memory_in_use,
            reserved_bytes=self.status.backend.get("reserved_bytes", 0), rate_tokens_per_s=round(self.batcher.rate),
            max_batch_tokens=self.batcher.batch_tokens, chunk_tokens=self.batcher.chunk_tokens,
            tower_tokens_per_patch=round(tower.per_patch, 4),
            tower_tokens_per_patch_squared=float(f"{tower.per_patch_squared:.4g}"),
            max_image_tokens=preparer.image_limits.per_image,
            max_request_image_tokens=preparer.image_limits.per_request,
            prompt_seconds_per_token=float(f"{self.prompt_limit.cost.per_token:.4g}"),
            prompt_seconds_per_token_pair=float(f"{self.prompt_limit.cost.per_token_pair:.4g}"),
            max_prompt_tokens=self.prompt_limit.tokens)

    async def _measure_prompts(self, preparer: Preparer, rate: float) -> PromptLimit:
        """How a prompt's time grows with its length on the first device (server/prompt_cost.py): a synthetic
        prompt run chunked as a long request runs, and the longest prompt taken. Where that limit bites, the run
        is repeated and each chunk counted at its faster time (noise only adds time, and a late chunk slowed by
        something else would refuse prompts the device runs in time). The wait is the longest any prompt is
        allowed (--max-queue-wait, or --min-queue-wait if larger). With chunking off (--chunk-tokens 0) nothing
        is measured, and only the context length (or a configured limit) bounds a prompt."""
        cfg = self.config
        context = cfg.engine.context_length
        budget = max(cfg.wait_budget, cfg.min_wait_budget)
        chunk = min(StepSize(cfg.chunk_tokens, cfg.step_budget).at(rate), cfg.reserve_limits["chunk_tokens"])
        if chunk <= 0:
            return PromptLimit.sized(cfg.max_prompt_tokens or context, PromptCost(1 / rate, 0.0), budget, context)
        limit = PromptLimit.sized(cfg.max_prompt_tokens, PromptCost(1 / rate, 0.0), budget, context)
        prompt = padded(preparer.prepare(support_ticket()), min(CONTEXT_CHUNKS * chunk + 1, context))
        fastest: list[tuple[int, int, float]] = []
        for _ in range(PROMPT_RUNS):
            samples = await self._chunked_run(prompt, chunk)
            fastest = [min(pair, key=lambda sample: sample[2]) for pair in zip(fastest, samples)] or samples
            # the first chunk pays for its warm-up, the last is one token and the head
            warm = [sample for sample in fastest[1:-1] if sample[1] == chunk]
            if len(warm) >= 2:
                limit = PromptLimit.sized(cfg.max_prompt_tokens, PromptCost.fit(warm), budget, context)
            if limit.tokens >= context:
                break
        return limit

    async def _chunked_run(self, prompt: Prepared, chunk: int) -> list[tuple[int, int, float]]:
        """``prompt`` run chunked on the first device as a long request runs: (offset, tokens, seconds) a step."""
        samples, offset = [], 0
        while True:
            step = await self.devices[0].step(prompt if not samples else None, chunk)
            if step.error is not None:
                raise step.error
            samples.append((offset, step.tokens, step.seconds))
            offset += step.tokens
            if step.done:
                return samples

    def health(self) -> Health:
        """What /health and /live answer now (see the module doc)."""
        lifecycle = self.lifecycle
        trouble = self.watch.trouble
        if lifecycle.phase == READY and trouble is not None:
            return Health(False, True, trouble.kind, trouble.reason, RETRY_AFTER_S)
        return Health(lifecycle.phase == READY, lifecycle.phase != FAILED,
                      "ok" if lifecycle.phase == READY else lifecycle.phase, lifecycle.reason,
                      1 if lifecycle.phase == DRAINING else RETRY_AFTER_S)

    def _publish_ready(self) -> None:
        self.metrics.ready.set(1 if self.health().ready else 0)

    def _device_trouble(self, trouble: Trouble | None) -> None:
        """A device's trouble began or ended (the watch says so): while any device is in trouble, no request is
        taken and the queued ones are refused at once (503), none of them having reached a device."""
        if trouble is not None and self.batcher is not None:
            self.batcher.refuse_queued(trouble.reason)
        self._publish_ready()

    def _device_expired(self, trouble: Trouble) -> None:
        """A device stayed stalled or faulted past the grace: its process is killed (the requests it was running
        fail, 500) and the service fails, as on a lost device."""
        if self.lifecycle.phase == FAILED:
            return
        reason = f"device {trouble.lane} was given up after {self.config.device_grace:g} s {trouble.kind}"
        self.batcher.kill(trouble.lane, reason)
        self._fail(reason)

    def _device_lost(self, reason: str) -> None:
        """A device process died: the requests it was running fail (500, its DeviceProcess does that) and the
        service fails."""
        self.watch.lost()
        log("device_lost", level="error", error=reason)
        self._fail(reason)

    def _fail(self, reason: str) -> None:
        """The service cannot answer any more: the queued requests are refused (503: none reached a device) and the
        service asks to be stopped (``clefcore serve`` then exits non-zero and is restarted; on several devices,
        whole, as a pod missing a GPU should be)."""
        self.lifecycle.set(FAILED, f"without a device: {reason}")
        if self.batcher is not None:
            self.batcher.refuse_queued(self.lifecycle.reason)
        self._publish_ready()
        self.lifecycle.stop_requested.set()

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests (Unavailable, "shutting down"), wait up to ``timeout_s`` for the accepted ones to
        be answered, then answer whatever is left with TimedOut. True when everything was answered in time (a
        failed service has nothing left to answer: False)."""
        lifecycle = self.lifecycle
        drained = lifecycle.phase != FAILED
        if drained:
            lifecycle.set(DRAINING, "shutting down")
            self._publish_ready()
        if self.batcher is not None:
            if drained:
                log("draining", queued=self.batcher.queued, in_flight=lifecycle.in_flight)
                drained = await lifecycle.wait_drained(self.batcher.idle, timeout_s)
                log("drained" if drained else "drain_timeout", in_flight=lifecycle.in_flight)
            self.watch.close()   # what is cut off now is no stall, nor a recovery
            await self.batcher.stop()
        return drained

    async def stop(self) -> None:
        """End the device processes and the prepare threads (after ``drain``, or after a failed ``start``)."""
        self.watch.close()
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
            return await self.answer(lambda: body, arrival, route="library", started=started)

    @contextlib.contextmanager
    def accept(self) -> Iterator[Arrival]:
        """A request from its arrival to its answer: refused with Unavailable unless the service is ready, and
        counted in flight meanwhile, so that ``drain`` waits for it. ``refuse_early`` and ``answer`` run in
        it, with the Arrival it yields."""
        self._refuse_unless_ready()
        lifecycle = self.lifecycle
        lifecycle.in_flight += 1
        arrival = Arrival()
        try:
            yield arrival
        finally:
            lifecycle.in_flight -= 1
            # a body given up before it was queued (bad, gone, failed)
            self.batcher.admission.release(arrival.hold)

    def _refuse_unless_ready(self) -> None:
        health = self.health()
        if not health.ready:
            raise Unavailable(health.reason, retry_after_s=health.retry_after_s)

    def _refuse_without_device(self) -> None:
        """Unavailable when a device failed while the request was read and prepared (a drain that began
        meanwhile still answers it): the queue it would join is refused already, and nothing takes from it."""
        health = self.health()
        if health.status in (FAILED, STALLED, FAULTED):
            raise Unavailable(health.reason, retry_after_s=health.retry_after_s)

    def refuse_early(self, arrival: Arrival, body_bytes: int | None) -> None:
        """Raise Overloaded, before the body is read and tokenized, when the queue is full or the work before a
        body of ``body_bytes`` (None: unknown) is over its budget: shedding load must be cheap. Otherwise the
        body's estimated size is held as work ahead of later arrivals until it is queued. Asked again once a
        compressed body's decoded size is known, it judges and holds that size as a plain body's."""
        admission = self.batcher.admission
        try:
            hold = admission.on_arrival(body_bytes)
        except Refused as refused:
            raise Overloaded(refused.refusal, self.batcher.capacity) from None
        admission.release(arrival.hold)
        arrival.hold = hold

    async def on_threads(self, nbytes: int, fn: Callable[[], T]) -> T:
        """``fn()`` on the prepare threads, in the turn of a body of ``nbytes`` (server/prepare.py: the
        smallest first, with aging), so that no body's decoding, parsing or tokenizing holds up the event
        loop or jumps the queue."""
        return await self._gate.run(nbytes, fn, self.executor)

    async def answer(self, read: Callable[[], Any], arrival: Arrival, *, route: str, started: float,
                     body_bytes: int | None = None, read_bytes: int = 0, trace: dict | None = None) -> dict:
        """Prepare the body that ``read()`` returns (as parsed from JSON; it runs on the prepare threads, and what
        it raises is raised here), queue it, wait for its forward (inside ``accept``). ``route``: the e2e
        latency histogram's label (the HTTP route's path, as on clef_requests_total), measured from ``started``
        (time.monotonic). ``body_bytes``: its size as a plain body when known, which teaches the early refusal
        tokens per byte; ``read_bytes``: its decoded size, its turn on the threads. ``trace`` (the request's log
        line) gets its tokens and its trip through the batcher."""
        cfg = self.config
        trace = {} if trace is None else trace
        prepared = await self.on_threads(read_bytes, lambda: self.preparer.prepare(read(),
                                                                                   on_overflow=cfg.on_overflow))
        trace["prompt_tokens"] = prepared.num_tokens
        self.prompt_limit.check(prepared.num_tokens)
        batcher = self.batcher
        # submit counts it exactly from here, with no await in between
        batcher.admission.on_prepared(arrival.hold, body_bytes, batcher.cost(prepared))
        self._refuse_without_device()
        deadline = time.monotonic() + cfg.request_timeout
        try:
            outcome = await batcher.submit(prepared, deadline)
        except Refused as refused:
            raise Overloaded(refused.refusal, batcher.capacity) from None
        except DeviceUnavailable as refused:
            raise Unavailable(refused.reason, retry_after_s=RETRY_AFTER_S) from None
        except DeadlineExceeded:
            raise TimedOut(cfg.request_timeout) from None
        except PromptTokensError:     # its run showed it slower than counted: the client's 413, as at arrival
            raise
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


def _preparer(cfg: ServiceConfig, commit: str | None, images_refused: str | None, tower: TowerCost,
              rate: float) -> Preparer:
    """The host side of requests (the model at ``commit``), with the image-token limits sized from the tower's
    measured cost where the model answers images."""
    checkpoint = Checkpoint(cfg.model, commit)
    limits = ImageLimits()
    if images_refused is None:
        limits = image_limits(cfg.max_image_tokens, cfg.max_request_image_tokens, tower,
                              StepSize(None, cfg.step_budget).at(rate), pixel_bounds(checkpoint.path))
    return Preparer(checkpoint, cfg.engine.context_length, cfg.engine.validation, images_refused, cfg.engine.regex,
                    limits)


def _mean_samples(samples: list[list[tuple[int, float]]]) -> list[tuple[int, float]]:
    """The tower's times measured on each device (the same kind), averaged per image size."""
    return [(runs[0][0], sum(seconds for _, seconds in runs) / len(runs)) for runs in zip(*samples)]
