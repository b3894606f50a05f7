"""The asyncio side of batching: futures, deadlines, disconnects, and the calls to the device processes.

Requests are queued in the Cython scheduler (``clefcore.scheduler``). Each device is a *lane*: its device process
(server/device_process.py), a dispatcher task of its own, the step it runs now and the long prompt it runs
chunked. A lane's dispatcher takes the next packed batch (or chunk step) from the shared queues whenever its
device is free and has its device process run it, so the event loop never waits on the model and no device
idles while work waits. Batching is continuous: whatever queued up while one forward ran is packed into the
next one, so under load batches grow by themselves and an idle server adds no delay; a batch stops growing
where it would end past the answer time promised to a request in it (the end of its budget, set at admission).
One device is one lane,
and everything below then reads as it did before lanes existed.

A device failure of a packed batch is retried request by request: only the request(s) that fail alone
get a 500, the rest of the batch is answered normally. Then the device runs its self-check, which tells a failed
request from a failed device; every call on a device is reported to the DeviceWatch (server/device_watch.py),
which judges stalls and faults. While a device is in trouble the Service refuses the queued requests
(``refuse_queued``): none of them has reached a device.

Steps: a packed batch is at most ``max_batch_tokens``, a chunk ``chunk_tokens``; each is a fixed number or auto,
the tokens of a step of ``step_budget`` seconds at the measured rate (server/steps.py), read again for every step.

Admission: the batcher's ``Admission`` (server/admission.py: the rate, the policy that ``ServiceConfig.admission``
picks, by default admission by cost, and the rest) is asked on every arrival, before a body is read (by the
Service) and once it is prepared (``submit``), and reads the queues and the lanes (``queues``); the batcher does
what it answers: queue the request with the answer time it was promised, refuse it at once (a 429), or give up a
queued long prompt (evicted); between steps it refuses the queued long prompts the policy finds too late.

Order: one order over all the work, shortest first with aging. A queued request's key is its arrival plus its
prompt tokens over the age rate (``age_rate``, by default a third of the measured device rate, AUTO_AGE_DIVISOR):
a request passes a longer one that arrived less than (difference in tokens) / age rate seconds before it, and
never one that arrived earlier than that, so no request waits behind shorter ones for longer than its own size's
worth of aging: at the default, three times its own run time.
Prompts that run whole are packed from the head of that order. A prompt longer than the chunk size runs as a
ChunkedRun, one chunk per step, one prompt at a time on a device: it starts when its key comes first (or no
whole prompt waits), and each next chunk takes its turn as a request of a chunk's size that arrived when the
previous step ended. So a short
request waits for about one step, a long prompt starts after at most its own size's worth of aging and then keeps
moving under a stream of short ones, and long prompts not yet started are what gives way when short work
overfills the device: the shipped policy refuses a queued one whose expected answer moves well past its promise
(``evicted``), and the largest queued one when the queue's count bound would refuse a smaller request.

Several lanes share the queues and the admission with its one measured rate (a per-device rate: every lane runs the same
model on the same kind of device). A chunked run's state lives in the device process of the lane that started
it, so its chunks all run on that lane; each lane runs at most one, and a free lane with none starts the next
long prompt when its key comes first. The admission arithmetic counts the work ahead of a request over all
lanes and lets it drain at N times the device's rate (server/admission.py's doc, "N lanes").
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from clefcore.engine import EngineStatus
from clefcore.errors import DeviceError, PromptTokensError
from clefcore.options import STEP_BUDGET_S
from clefcore.scheduler import Entry, Scheduler

from . import admission
from .admission import Admission, Budgets, Queues, QueueView, Refused
from .device_process import DeviceProcess, Step
from .device_watch import RECHECK_S, DeviceWatch
from .image_cost import TowerCost
from .logs import log
from .metrics import Metrics
from .prompt_cost import PromptLimit
from .steps import StepSize

# --age-rate auto: the measured rate over this. A request is passed by shorter work for at most this many times
# its own run time. Under short work that fills the device by itself, a chunked prompt is then answered after
# about 2 x 3 + 1 = 7 times its own run time (its aging, its run, the shorter work each chunk lets pass), and the
# short work keeps about 6/7 of the device: with the measured rate itself (1), a third of the device went to a
# stream of 3k-token prompts beside short ones, and the short ones waited half as long as the long ones.
AUTO_AGE_DIVISOR = 3


class DeadlineExceeded(Exception):
    pass


class DeviceUnavailable(Exception):
    """Refused while queued, before it reached a device, because the devices are stalled, faulted or lost
    (``reason``): another replica may answer it."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


T = TypeVar("T")


@dataclass
class Outcome:
    """A request's answer plus what the request log line and the metrics want to know about its trip."""
    response: dict
    queue_wait_s: float
    prefill_s: float
    batch_requests: int
    batch_tokens: int


@dataclass
class _Chunked:
    """The long prompt being run chunk by chunk (its state lives in the device process from the first step):
    its entry, the tokens its run has left, when its first step started, and the device time its steps took."""
    entry: Entry
    tokens_left: int       # its cost left: prompt tokens, and the towers of the images not yet run
    images_left: int       # images not yet through the vision tower
    begun: bool = False    # its first step was sent
    started: float = 0.0
    device_s: float = 0.0
    chunks: list = field(default_factory=list)   # its text chunks: (offset, tokens, device seconds) each
    ready_at: float = 0.0  # when its next chunk became due: the end of the last step


@dataclass(eq=False)
class _Lane:
    """One device: its process, the step on it now (a batch or a chunk: its tokens and when it started), the
    batch's entries and tokens, and the long prompt it runs chunked (whose state lives in this lane's device
    process, so all its chunks run here)."""
    device: DeviceProcess
    label: str                   # its place in the device list: the busy counter's label
    running: list = field(default_factory=list)
    running_tokens: int = 0
    step_tokens: int = 0
    step_started: float = 0.0
    active: _Chunked | None = None
    task: asyncio.Task | None = None


class Batcher:
    def __init__(self, devices: Sequence[DeviceProcess], metrics: Metrics, *, watch: DeviceWatch, max_queue: int,
                 max_batch_tokens: int | None, max_batch_requests: int, budgets: Budgets, start_rate: float,
                 chunk_tokens: int | None = None, step_budget: float = STEP_BUDGET_S, age_rate: float | None = None,
                 first_lane: int = 0, policy: admission.PolicyFactory | None = None,
                 tower: TowerCost = TowerCost(0.0, 0.0), tower_ceiling: TowerCost | None = None,
                 prompt_limit: PromptLimit | None = None):
        """``devices``: the device process of each lane. ``watch``: told of every call on a device and of every
        self-check's outcome.
        ``max_batch_tokens``: the tokens of a packed batch (None: auto, see the module doc).
        ``budgets``: the wait a request of each size may be admitted into (admission.Budgets), given to
        ``policy``, which builds the admission policy from them (None: admission.CostPolicy).
        ``chunk_tokens``: prompts longer than this run chunked, in chunks of this size (None: auto, as
        ServiceConfig's; 0: never).
        ``step_budget``: the seconds an auto-sized step takes at the measured rate.
        ``start_rate``: the device rate (tokens/s) measured at start (admission.measured_rate), which every step
        then moves.
        ``age_rate``: the scheduler's aging in tokens per second of waiting (None: follow the measured device
        rate over AUTO_AGE_DIVISOR; inf: first in, first out). ``first_lane``: the busy counter's label of the
        first device (its place in --device). ``tower``: what an image's vision tower costs, in prompt tokens
        (server/image_cost.py); every count of work here (admission, steps, rates) is in that unit.
        ``tower_ceiling``: a tower cost that errs towards cost (TowerCost.ceiling; None: ``tower``), which the
        stall limit counts images at, so that a long tower is never taken for a hung device.
        ``prompt_limit``: the longest prompt taken (server/prompt_cost.py), whose budget a chunked run that shows
        itself slower than counted is refused at (None: none)"""
        self._metrics = metrics
        self._watch = watch
        self._tower = tower
        self._tower_ceiling = tower if tower_ceiling is None else tower_ceiling
        self._prompt_limit = prompt_limit
        self.admission = Admission((policy or admission.CostPolicy)(budgets), start_rate, self,
                                   rejected=metrics.rejected, held_tokens=metrics.held_tokens,
                                   on_rate=self._follow)
        self._follow_rate = age_rate is None
        self._scheduler = Scheduler(max_queue, self.admission.rate / AUTO_AGE_DIVISOR if age_rate is None
                                    else age_rate)
        self._batch_size = StepSize(max_batch_tokens, step_budget)
        self._chunk_size = StepSize(chunk_tokens, step_budget)
        self._max_requests = max_batch_requests
        self._lanes = [_Lane(device, str(first_lane + i)) for i, device in enumerate(devices)]
        for lane in self._lanes:   # each lane's busy series from the start, at 0: a rate needs two points
            metrics.device_busy.labels(lane.label)
        self._wake = asyncio.Event()   # work was queued: for every lane's dispatcher that has none
        # long prompts waiting for their chunked run (capacity: ``full`` counts both queues together)
        self._long = Scheduler(max_queue, self._scheduler.age_rate)
        self._follow(self.admission.rate)

    @property
    def capacity(self) -> int:
        return self._scheduler.capacity

    @property
    def queued(self) -> int:
        return len(self._scheduler) + len(self._long)

    def full(self) -> bool:
        return self.queued >= self._scheduler.capacity

    def idle(self) -> bool:
        return self.queued == 0 and all(not lane.running and lane.active is None for lane in self._lanes)

    @property
    def rate(self) -> float:
        return self.admission.rate

    @property
    def batch_tokens(self) -> int:
        """The most prompt tokens of a packed batch now."""
        return self._batch_size.at(self.admission.rate)

    @property
    def chunk_tokens(self) -> int:
        """The tokens of a chunk now; a longer prompt is queued to run chunked (0: none is)."""
        return self._chunk_size.at(self.admission.rate)

    def cost(self, prepared: Any) -> int:
        """What a prepared request costs the device, in prompt tokens: its own and its images' vision towers."""
        return self._tower.request(prepared)

    def backlog_tokens(self) -> int:
        """Tokens of accepted work not yet done: queued short prompts, the batches on the devices, queued long
        prompts and what is left of those running chunked."""
        tokens = self._scheduler.live_tokens + sum(lane.running_tokens for lane in self._lanes)
        tokens += self._long.live_tokens
        return tokens + sum(lane.active.tokens_left for lane in self._lanes if lane.active is not None)

    def _chunk_key(self, lane: _Lane) -> float:
        """The lane's next chunk step's place in the scheduler's order: that of a queued request of the chunk's
        size that arrived when the chunk became due (inf: no chunked run started there)."""
        if lane.active is None:
            return math.inf
        return lane.active.ready_at + min(self.chunk_tokens, lane.active.tokens_left) / self._scheduler.age_rate

    def queues(self) -> Queues:
        """The queues and the lanes as admission reads them (admission.QueueSource)."""
        lanes = tuple(admission.LaneView(lane.step_tokens, lane.step_started,
                                         None if lane.active is None else lane.active.tokens_left,
                                         self._chunk_key(lane)) for lane in self._lanes)
        whole = self._scheduler
        return Queues(self.chunk_tokens, QueueView(whole.age_rate, whole.live_tokens, whole.tokens_before),
                      self._long.keyed(), lanes, self.full())

    def _publish(self) -> None:
        backlog = self.backlog_tokens()
        self._metrics.queue_depth.set(self.queued)
        self._metrics.queued_tokens.set(backlog)
        self._metrics.estimated_wait.set(backlog / (len(self._lanes) * self.admission.rate))

    def _stepped(self, lane: _Lane, tokens: int, seconds: float) -> None:
        """A step on the lane's device ended: its time counts as that device's busy time, and admission learns
        from it (the rate, and whether whole prompts waited during it)."""
        self._metrics.device_busy.labels(lane.label).inc(seconds)
        self.admission.on_step(tokens, seconds, started=lane.step_started, now=time.monotonic(),
                               waiting_since=self._scheduler.waiting_since if len(self._scheduler) else None)

    def _follow(self, rate: float) -> None:
        """The measured rate moved to ``rate``: the auto step sizes and, by default, the aging follow it."""
        self._metrics.device_rate.set(rate)
        self._metrics.step_tokens.labels("max_batch_tokens").set(self.batch_tokens)
        self._metrics.step_tokens.labels("chunk_tokens").set(self.chunk_tokens)
        if self._follow_rate:
            # A short prompt passes a long one that arrived less than three times the long one's run time earlier.
            self._scheduler.set_age_rate(rate / AUTO_AGE_DIVISOR)
            self._long.set_age_rate(rate / AUTO_AGE_DIVISOR)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        for lane in self._lanes:
            lane.task = loop.create_task(self._dispatch(lane), name=f"clef-dispatch-{lane.label}")
            lane.task.add_done_callback(_dispatch_ended)

    async def stop(self) -> None:
        """The drain timeout has passed: answer everything still queued or on a device with a timeout
        (so no accepted request is cut off without an answer) and stop the dispatchers."""
        started = [entry for lane in self._lanes for entry in lane.running]
        started += [lane.active.entry for lane in self._lanes if lane.active is not None]
        for entry in self._scheduler.drain() + self._long.drain() + started:
            _, future = entry.payload
            if not future.done():
                future.set_exception(DeadlineExceeded())
        tasks = [lane.task for lane in self._lanes if lane.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def refuse_queued(self, reason: str) -> None:
        """Answer every queued request with DeviceUnavailable(``reason``): the devices are stalled, faulted or lost,
        and none of these requests has reached one. The steps on the devices, and the chunked runs started, are
        left to their devices."""
        for entry in self._scheduler.drain() + self._long.drain():
            _, future = entry.payload
            if not future.done():
                future.set_exception(DeviceUnavailable(reason))
        self._publish()

    def kill(self, lane: str, reason: str) -> None:
        """End the device process of the lane labelled ``lane`` (given up: it stopped answering or fails every
        call); the calls waiting on it fail with DeviceError(``reason``)."""
        next(each for each in self._lanes if each.label == lane).device.kill(reason)

    async def submit(self, prepared: Any, deadline: float) -> Outcome:
        """Queue one prepared request and wait for its answer. Raises admission.Refused at once when it is not
        admitted, DeadlineExceeded when ``deadline`` (time.monotonic) passes first, or the device's error."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        now = time.monotonic()
        cost = self.cost(prepared)
        decision = self.admission.admit(cost, now)
        if decision.evict is not None:
            self._evict(decision.evict)
        # promised its answer by ``answer_by``: the batch it rides is cut to keep that (pyx/scheduler.pyx)
        entry = Entry((prepared, future), cost, deadline, now, decision.answer_by)
        long = admission.runs_chunked(entry.tokens, self.chunk_tokens)
        # the shipped policy never admits into a full queue (it counts the bound over both queues); another may
        if not (self._long if long else self._scheduler).push(entry):
            raise self.admission.queue_full(entry.tokens, decision.answer_by - now)
        self._publish()
        self._wake.set()
        try:
            return await asyncio.wait_for(future, timeout=max(deadline - now, 0.0))
        except asyncio.TimeoutError:
            self._forget(entry, long)
            raise DeadlineExceeded() from None
        except asyncio.CancelledError:
            # The client went away (aiohttp cancels the handler): give the slot back; if the request is
            # already on the device its result is simply dropped, and a chunked run stops at its next step.
            if self._forget(entry, long):
                self._metrics.cancelled.inc()
            raise
        finally:
            self._publish()

    def _forget(self, entry: Entry, long: bool) -> bool:
        """Drop an abandoned request from whichever queue holds it; True when it was still queued. A chunked
        run already started stops at its next step, which sees its settled future."""
        queued = entry.queued
        (self._long if long else self._scheduler).cancel(entry)
        return queued

    def _evict(self, eviction: admission.Eviction) -> None:
        """Refuse a queued long prompt that has not started (admission counted it): its caller gets the 429
        now."""
        entry = eviction.entry
        self._long.cancel(entry)
        _, future = entry.payload
        if not future.done():
            future.set_exception(Refused(eviction.refusal))

    def _evict_late(self, now: float) -> None:
        """Refuse the queued long prompts admission finds too late now (``late``)."""
        if len(self._long):
            for eviction in self.admission.late(now):
                self._evict(eviction)

    async def _dispatch(self, lane: _Lane) -> None:
        while True:
            if len(self._scheduler) == 0 and len(self._long) == 0 and lane.active is None:
                # Cleared only by a lane that sees nothing queued, right before it waits: a push after this
                # sets it again, so no lane sleeps through work.
                self._wake.clear()
                await self._wake.wait()
            self._evict_late(time.monotonic())
            # Whatever comes first in the order (module doc): the lane's started run's next chunk, or where the
            # lane runs none, the next long prompt's start; else the whole prompts at the head.
            whole = self._scheduler.head_key()    # inf: none waits
            if lane.active is not None:
                await (self._chunk_step(lane) if self._chunk_key(lane) <= whole else self._short_batch(lane))
            elif len(self._long) and self._long.head_key() <= whole:
                await self._chunk_step(lane)
            elif len(self._scheduler):
                await self._short_batch(lane)

    def _expire(self, entries) -> None:
        """Answer the entries a queue dropped past their deadline with a timeout."""
        for entry in entries:
            self._metrics.expired.inc()
            _, future = entry.payload
            if not future.done():
                future.set_exception(DeadlineExceeded())

    async def _short_batch(self, lane: _Lane) -> None:
        batch = self._scheduler.take(self.batch_tokens, self._max_requests, time.monotonic(), self.admission.rate)
        self._expire(batch.expired)
        if not batch.entries:
            self._publish()
            return
        started = time.monotonic()
        prepared = [entry.payload[0] for entry in batch.entries]
        lane.running = batch.entries
        lane.running_tokens = lane.step_tokens = batch.tokens
        lane.step_started = started
        self._publish()
        self._metrics.running.inc(len(prepared))
        try:
            ceiling = sum(self._tower_ceiling.request(p) for p in prepared)
            results, prefill_s = await self._on_device(lane, "forward", ceiling, lane.device.infer(prepared))
        except DeviceError as lost:   # the device process is gone (the server is exiting)
            results, prefill_s = [(None, lost)] * len(prepared), 0.0
        finally:
            lane.running = []
            lane.running_tokens = lane.step_tokens = 0
            self._metrics.running.dec(len(prepared))
        self._stepped(lane, batch.tokens, prefill_s)
        self._publish()
        self._metrics.batches.inc()
        self._metrics.after_batch(self.lane_statuses())
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
        if any(error is not None for _, error in results):
            await self._check(lane)

    def lane_statuses(self) -> dict[str, EngineStatus]:
        """Each device's engine status by its lane (the busy and memory series' label)."""
        return {lane.label: lane.device.status for lane in self._lanes}

    async def _chunk_step(self, lane: _Lane) -> None:
        """Run the next chunk of the lane's long prompt (starting the next queued one there if it runs none)."""
        now = time.monotonic()
        if lane.active is None:
            batch = self._long.take(0, 1, now)
            self._expire(batch.expired)
            if not batch.entries:
                self._publish()
                return
            entry = batch.entries[0]
            lane.active = _Chunked(entry, entry.tokens, len(entry.payload[0].images), started=now,
                                   ready_at=entry.enqueued_at)
            self._metrics.queue_wait.observe(now - entry.enqueued_at)
        active = lane.active
        _, future = active.entry.payload
        if future.done() or active.entry.deadline <= now:  # the client left or the deadline passed
            if not future.done():
                self._metrics.expired.inc()
                future.set_exception(DeadlineExceeded())
            lane.active = None
            self._publish()
            if active.begun:   # its state on the device goes now, not at the next long prompt
                await self._on_device(lane, "drop", 0, lane.device.drop())
            return
        self._metrics.running.inc()
        chunk = self.chunk_tokens
        prepared = active.entry.payload[0]
        images, tower = self._tower_block(prepared.images, active.images_left, chunk)
        lane.step_tokens = tower if images else min(chunk, active.tokens_left)
        first = len(prepared.images) - active.images_left
        ceiling = self._tower_ceiling.images(prepared.images[first:first + images]) if images else lane.step_tokens
        lane.step_started = now
        active.ready_at = now + lane.step_tokens / self.admission.rate  # the step's expected end, until it ends
        try:
            step = await self._on_device(lane, "vision tower step" if images else "chunk step", ceiling,
                                         lane.device.step(None if active.begun else prepared, chunk, images))
        except DeviceError as lost:   # the device process is gone (the server is exiting)
            step = Step(True, None, 0, 0, lost, 0.0)
        finally:
            self._metrics.running.dec()
            lane.step_tokens = 0
            active.ready_at = time.monotonic()
        active.begun = True
        # a guard trip restarts the run: its images and tokens grow back, and the step counts nothing
        towered = self._tower.images(prepared.images[len(prepared.images) - active.images_left:
                                                     len(prepared.images) - step.images_left])
        active.images_left = step.images_left
        active.tokens_left = step.tokens_left + self._tower.images(prepared.images[len(prepared.images)
                                                                                   - step.images_left:])
        active.device_s += step.seconds
        self._metrics.chunk_steps.inc()
        self._stepped(lane, step.tokens + towered, step.seconds)
        if not images and step.error is None and not step.done:
            active.chunks.append((prepared.num_tokens - step.tokens_left - step.tokens, step.tokens, step.seconds))
            over = self._overrun(prepared, step.tokens_left, active, chunk)
            if over is not None:    # refused at its own pace: its state on the device goes now
                lane.active = None
                if not future.done():
                    future.set_exception(over)
                self._publish()
                await self._on_device(lane, "drop", 0, lane.device.drop())
                return
        if step.done:
            lane.active = None
            self._metrics.after_batch(self.lane_statuses())
            self._metrics.prefill.observe(active.device_s)
            if not future.done():
                if step.error is not None:
                    future.set_exception(step.error)
                else:
                    future.set_result(Outcome(step.response, active.started - active.entry.enqueued_at,
                                              active.device_s, 1, active.entry.tokens))
        self._publish()
        if step.error is not None:
            await self._check(lane)

    def _overrun(self, prepared: Any, left: int, active: _Chunked, chunk: int) -> PromptTokensError | None:
        """A chunked run whose pace so far says it would pass the prompt limit's budget (PromptLimit.overrun),
        judged from its second text chunk on (its first may pay for a warm-up)."""
        done = prepared.num_tokens - left
        if self._prompt_limit is None or done < 2 * chunk:
            return None
        text_s = sum(seconds for _, _, seconds in active.chunks)
        return self._prompt_limit.overrun(prepared.num_tokens, done, text_s, active.chunks)

    def _tower_block(self, images: Sequence, left: int, chunk: int) -> tuple[int, int]:
        """The next step of a chunked run while ``left`` of its ``images`` are not through the vision tower: the
        next of them whose towers fit a chunk's ``chunk`` tokens together (at least one; the image-token limit
        keeps one within a step at the device's rate), and what their towers cost. (0, 0) when none is left."""
        count = cost = 0
        for pixels in images[len(images) - left:]:
            one = self._tower.images([pixels])
            if count and cost + one > chunk:
                break
            count, cost = count + 1, cost + one
        return count, cost

    async def _on_device(self, lane: _Lane, what: str, tokens: int, call: Awaitable[T]) -> T:
        """Await ``call`` on the lane's device (``what``, costing ``tokens`` prompt tokens with images at the tower's
        ceiling), watched for a stall."""
        self._watch.started(lane.label, what, tokens, self.admission.rate)
        try:
            return await call
        finally:
            self._watch.ended(lane.label)

    async def _check(self, lane: _Lane) -> None:
        """A call on the lane's device failed: the device runs its self-check (a built-in request) to tell whether
        the request failed or the device did. Passing, only those requests failed. Failing, the device is faulted
        (the watch makes the service unavailable, and gives the device up if it stays so) and checks again every
        RECHECK_S until it passes; it takes no work meanwhile. A lost process is the Service's to handle."""
        while lane.device.lost is None:
            try:
                await self._on_device(lane, "self-check", 0, lane.device.self_check())
            except Exception as error:  # noqa: BLE001 - whatever it raised, the device failed its check
                if lane.device.lost is not None:
                    return
                self._watch.faulted(lane.label, f"{type(error).__name__}: {error}")
                await asyncio.sleep(RECHECK_S)
            else:
                self._watch.checked(lane.label)
                return


def _dispatch_ended(task: asyncio.Task) -> None:
    """A dispatcher that ends other than by stop() leaves every queued request unanswered: say why, loudly."""
    if not task.cancelled() and task.exception() is not None:
        error = task.exception()
        log("dispatch_failed", level="error", error=f"{type(error).__name__}: {error}")
