"""Admission: whether a request is queued, refused (a 429) or displaces queued work. ``Admission`` (at the end)
owns all of it: the measured rate, the body sizer, the held bodies, the waiting share, the policy and the
refusal counter; server/batcher.py does the dispatch and asks it, and the Service asks it when a request
arrives. ``ServiceConfig.admission`` picks the policy (None: ``CostPolicy``).

The seam: an ``AdmissionPolicy`` reads a ``Snapshot`` of the queues and the lanes in plain values, taken at the
moment of the question, and answers ``Admit`` (with the answer time it promises, and a queued long prompt to
give up to make room), a ``Refusal`` (its ``Reason``, as the wire names it; the expected wait, the budget,
Retry-After) or, between device steps, the ``Eviction``s of queued long prompts (entries of the snapshot's
``long``) that will be answered too late. The promise is kept by the
scheduler's cut: a batch stops growing where it would end past a promise in it (pyx/scheduler.pyx, ``take``).

The shipped policy, admission by cost (``CostPolicy``):

Budget: the wait a caller tolerates, in seconds, as a function of its prompt's size. ``max_s`` for a prompt of
``context_tokens``, in proportion below that, never under ``min_s``; and never under what the scheduler's order
alone can make it wait: one device step, the next chunk of a long prompt, and its own run (a request is never
refused for the step that happens to be running); for a prompt that runs chunked, also its aging and the shorter
work that passes its chunks while whole prompts keep coming.

A request is admitted when its expected time to its answer fits its budget, and is then promised its answer by
the end of that budget: the batch it rides is cut where it would end later (pyx/scheduler.pyx, ``take``). That
time counts only the work that runs before it in the scheduler's order (shortest first with aging, over all the
work: server/batcher.py's doc), at the measured device rate. For a prompt that runs whole: what is left of the
running step, the queued prompts ahead of it, at most one chunk of the long prompt being run and the first chunk
of a queued long prompt whose key comes first. For a chunked prompt, two cases weighed by the share of recent
time in which whole prompts were waiting (never less than the part of its wait the whole prompts queued now
take to run): when none come, the whole prompts ahead of it, the runs and long prompts before it, then its own
run; when they keep coming, shorter ones pass it until its key comes up and between the chunks of every run, so
it starts at the latest of its key, the end of the whole work sorted before it and the end of the runs before
it, and runs slower than its tokens by what passes each chunk. A queued long prompt whose expected answer moves
well past its promise (the later of the one made at admission and the budget the order gives its size now) is
refused then (evicted). So when the device cannot keep up, the most expensive requests are the ones refused,
and a short one is refused only when short work alone exceeds what the device does.

The first check, before a body is read, takes the body's size as tokens (BodySizer) and adds the bodies that
passed it earlier and are still being read and tokenized, those no larger in bytes, as work ahead (the
holds): they will be queued before it.

N lanes (a Service on N devices, server/batcher.py): one queue, N devices that each take the next step when
free, one measured rate r per device. The work ahead of a request is counted over all lanes and drains at N r;
its own run is on one device, at r. For a whole prompt: (what is left of each lane's running step + the queued
prompts ahead of it + one chunk of each lane whose started run's next chunk sorts before it + the first chunk of
each long prompt that starts before it on a lane running none) / (N r) + its own tokens / r. For a chunked
prompt the work before it, the runs' rest and the long prompts ahead likewise drain at N r, and its own run is
at r. The budget's floor: (the sum over lanes of one step each, a chunk or the step running there if longer, +
N chunks + N times its own tokens) / (N r), which is one device's floor when every lane is idle. This counts the
lanes as one fluid device N times as fast: a long prompt that a free lane could start at once is counted behind
the other lanes' chunked runs too, so it errs towards refusing. With N = 1 every term is the one device's above,
computed in the same order, so the numbers are exactly those.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from prometheus_client import Counter, Gauge

from clefcore.scheduler import Entry

# Guesses that size the forward measuring the rate at start: the H200 packs ~24k prompt tokens/s on clef-flash;
# the CPU path serves the tiny test model at a few thousand.
START_RATE = {"cpu": 2_000.0, "cuda": 20_000.0}
# Weight of one forward of `_HALF_TOKENS` tokens in the mean; larger forwards weigh more, up to 0.5.
_HALF_TOKENS = 8_192
_MAX_WEIGHT = 0.5
# A queued long prompt is evicted once its expected answer is this share of its budget past its promise: it has
# waited already, and the expected answer moves by a step or so each time the whole prompts sorted before it are
# counted between two steps.
EVICT_SLACK = 0.25


class Reason(StrEnum):
    """Why a request is refused: its value is what the 429's body and the refusal counter's label say."""
    QUEUED_WORK = "queued_work"   # the work before it would outlast its budget
    QUEUE_FULL = "queue_full"     # the queues hold their bound in requests, and nothing queued gives way
    EVICTED = "evicted"           # admitted, then displaced by cheaper work before it started


# Size classes of the refusal counter's label (prompt tokens, upper bounds).
SIZE_CLASSES = (1024, 2048, 4096, 8192, 16384)


def start_rate(device: str) -> float:
    """The rate guessed for ``device`` ("cpu", "cuda", "cuda:N") before anything is measured: it sizes the
    forward that measures it at start."""
    return START_RATE["cpu" if device == "cpu" else "cuda"]


def measured_rate(runs: list[tuple[int, float]]) -> float:
    """Tokens per second of device time over ``runs`` ((tokens, seconds) each: the Service's measurement at
    start, one per device)."""
    tokens, seconds = sum(t for t, _ in runs), sum(s for _, s in runs)
    if not (tokens > 0 and seconds > 0):
        raise ValueError(f"a rate needs tokens and time, got {tokens} tokens in {seconds} s")
    return tokens / seconds


class RateMeter:
    """Tokens per second of device time, smoothed, from ``start``: the rate measured at start (a forward sized
    like a step on the warm device), which every step's rate then moves."""

    def __init__(self, start: float):
        if not start > 0:
            raise ValueError(f"start rate must be > 0 tokens/s, got {start}")
        self.rate = float(start)

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not seconds > 0:
            return
        weight = max(0.05, min(_MAX_WEIGHT, 0.25 * tokens / _HALF_TOKENS))
        self.rate += weight * (tokens / seconds - self.rate)


class RecentShare:
    """The share of recent wall time that something held (here: whole prompts waiting for the device), an
    exponentially weighted mean over ``tau_s``, updated at the end of every device step."""

    def __init__(self, tau_s: float = 2.0):
        self._tau = tau_s
        self._share = 0.0
        self._at: float | None = None

    def step(self, end: float, held_s: float) -> None:
        """A step ended at ``end``; for ``held_s`` of the time since the last one it held."""
        if self._at is None:
            self._at = end - held_s
        span = end - self._at
        if span > 0:
            keep = math.exp(-span / self._tau)
            self._share = keep * self._share + (1 - keep) * min(1.0, held_s / span)
            self._at = end

    def share(self, now: float) -> float:
        if self._at is None:
            return 0.0
        return self._share * math.exp(-max(0.0, now - self._at) / self._tau)


@dataclass(frozen=True)
class Budgets:
    """Seconds of wait a caller tolerates by prompt size (see the module doc)."""
    min_s: float
    max_s: float
    context_tokens: int

    def __post_init__(self):
        if not (self.min_s > 0 and self.max_s > 0 and self.context_tokens > 0):
            raise ValueError(f"budgets must be > 0: min {self.min_s} s, max {self.max_s} s, "
                             f"context {self.context_tokens} tokens")

    def __call__(self, tokens: int) -> float:
        return max(self.min_s, self.max_s * tokens / self.context_tokens)


@dataclass(frozen=True)
class Refusal:
    """Why a request is not admitted; ``retry_after_s`` is whole seconds, as the header wants. ``reason`` may be
    given as its wire name ("queued_work"), and is a Reason from then on."""
    reason: Reason
    retry_after_s: int
    wait_s: float          # expected wait had it been admitted (or kept)
    budget_s: float

    def __post_init__(self):
        try:
            object.__setattr__(self, "reason", Reason(self.reason))
        except ValueError:
            raise ValueError(f"reason must be one of {', '.join(Reason)}, got {self.reason!r}") from None


class Refused(Exception):
    """A request not admitted, or evicted before it started: ``refusal`` says why."""

    def __init__(self, refusal: Refusal):
        super().__init__(refusal.reason.value)
        self.refusal = refusal


def retry_after(wait_s: float, budget_s: float, cap_s: float) -> int:
    """Whole seconds until the expected wait fits the budget again: at least 1, at most ``cap_s``."""
    over = wait_s - budget_s
    return max(1, math.ceil(min(over, cap_s))) if not math.isnan(over) else 1


SIZE_LABELS = (*(str(bound) for bound in SIZE_CLASSES), "+Inf", "unknown")


def size_class(tokens: int | None) -> str:
    """The refusal counter's label for a prompt of ``tokens`` (None: not known, a body refused unread whose
    size could not be estimated): one of SIZE_LABELS."""
    if tokens is None:
        return "unknown"
    return next((str(bound) for bound in SIZE_CLASSES if tokens <= bound), "+Inf")


class BodySizer:
    """Prompt tokens from a body's size, at the bytes per token of recent requests of a similar size: the estimate
    the admission check uses before a body is read and tokenized, so that shedding load costs no parsing.

    The estimate's error is the spread of those samples, widened by ``MARGIN``. Bodies shaped alike (one
    client's template) give a narrow span, so a body that would be refused at every size in it is refused
    unread. Few or scattered samples (images, mixed clients) keep the span at half to twice the guess, and a
    body whose span the check cannot judge is tokenized and checked exactly. Only bodies within a factor of
    ``NEAR`` in size count: a template's fixed part weighs more in a short body than in a long one."""

    WINDOW = 256         # recent samples kept
    NEAR = 2.0           # samples from bodies this many times smaller or larger count
    MIN_SAMPLES = 8      # fewer near samples: the widest span
    MARGIN = 0.1         # beyond the extremes seen
    WIDEST = (0.5, 2.0)  # the span never reaches past these multiples of the guess

    MEMO = 1024          # body sizes whose estimates are kept between samples

    def __init__(self):
        self._samples: deque[tuple[int, float]] = deque(maxlen=self.WINDOW)  # (body bytes, bytes per token)
        # Every arrival asks, a retry storm thousands of times a second, mostly for a few body sizes; the answer
        # changes only with a new sample (one per prepared request). A profile of such a storm had the samples'
        # scan at a sixth of the event loop's time.
        self._memo: dict[int, tuple[int, ...]] = {}

    def observe(self, nbytes: int | None, tokens: int) -> None:
        if nbytes and tokens > 0:
            self._samples.append((nbytes, nbytes / tokens))
            self._memo.clear()

    def estimates(self, nbytes: int | None) -> tuple[int, ...]:
        """Token counts spanning the estimate's error (lowest, guess, highest); empty until a request was
        measured."""
        if not nbytes or not self._samples:
            return ()
        known = self._memo.get(nbytes)
        if known is None:
            if len(self._memo) >= self.MEMO:
                self._memo.clear()
            known = self._memo[nbytes] = self._estimate(nbytes)
        return known

    def _estimate(self, nbytes: int) -> tuple[int, ...]:
        near = [ratio for size, ratio in self._samples if nbytes / self.NEAR <= size <= nbytes * self.NEAR]
        mid = statistics.median(near or [ratio for _, ratio in self._samples])
        lo, hi = self.WIDEST
        if len(near) >= self.MIN_SAMPLES:
            # more bytes per token than the median means fewer tokens than guessed, and the other way round
            lo = max(lo, mid / (max(near) * (1 + self.MARGIN)))
            hi = min(hi, mid / (min(near) * (1 - self.MARGIN)))
        guess = nbytes / mid
        return tuple(max(1, round(guess * f)) for f in (lo, 1.0, hi))


@dataclass(eq=False)
class Hold:
    """A body that passed the check on arrival and is being read and prepared: its estimated prompt tokens count
    as work ahead of later arrivals whose bodies are no smaller until it is queued or given up
    (``Admission.release``). Without it, every client of a burst that finds the queue short passes the check at
    once, and all but the first few are refused only after the prepare threads have tokenized them, each
    waiting its turn there. Bodies are ordered by bytes, not by estimated tokens: two bodies of one kind share
    the estimate's error, so a body as large as a held one is no shorter, while its low estimate would sort it
    ahead of every held body of its size."""
    tokens: int
    nbytes: int


@dataclass(frozen=True)
class QueueView:
    """The queue of whole prompts as a policy reads it: its aging (prompt tokens of priority a second of waiting
    earns), the tokens queued, and ``tokens_before(key)``, the tokens queued that run before an entry of order
    ``key``. That one asks the queue when called, without copying it (a snapshot is used at once: copying the
    queue for every arrival would cost a retry storm O(queue) more)."""
    age_rate: float
    live_tokens: int
    tokens_before: Callable[[float], float]

    def key(self, tokens: int, now: float) -> float:
        """The order key of a request of ``tokens`` queued at ``now`` (pyx/scheduler.pyx's)."""
        return now + tokens / self.age_rate


@dataclass(frozen=True)
class LaneView:
    """One lane as admission sees it: the step on its device (its tokens, 0: none, and when it started) and the
    chunked run there (the tokens it has left and its next chunk's order key; None and inf: it runs none)."""
    step_tokens: int
    step_started: float
    run_left: int | None
    chunk_key: float


def runs_chunked(tokens: int, chunk_tokens: int) -> bool:
    """A prompt of ``tokens`` runs chunked when chunks are ``chunk_tokens`` (0: none does)."""
    return 0 < chunk_tokens < tokens


@dataclass(frozen=True)
class Queues:
    """What the batcher tells admission of its queues and lanes (``QueueSource.queues``)."""
    chunk_tokens: int           # a longer prompt runs chunked (0: none does)
    whole: QueueView
    long: tuple[tuple[Entry, float], ...]   # the queued long prompts and their order keys, in arrival order
    lanes: tuple[LaneView, ...]
    full: bool                  # the queues hold their bound in requests


class QueueSource(Protocol):
    """The batcher, as admission sees it."""

    def queues(self) -> Queues:
        """The queues and the lanes now."""


@dataclass(frozen=True)
class Snapshot:
    """What a policy reads, taken at ``now``: the batcher's ``Queues`` and what admission measured."""
    now: float
    rate: float                 # the measured device rate, tokens/s per device
    chunk_tokens: int           # a longer prompt runs chunked (0: none does)
    whole: QueueView
    long: tuple[tuple[Entry, float], ...]   # the queued long prompts and their order keys, in arrival order
    lanes: tuple[LaneView, ...]
    whole_share: float          # the recent share of time whole prompts were waiting (RecentShare)
    full: bool                  # the queues hold their bound in requests

    def chunked(self, tokens: int) -> bool:
        """A prompt of ``tokens`` runs chunked."""
        return runs_chunked(tokens, self.chunk_tokens)


@dataclass(frozen=True)
class Eviction:
    """A queued long prompt, not started, refused now (``refusal``: its reason is EVICTED)."""
    entry: Entry
    refusal: Refusal


@dataclass(frozen=True)
class Admit:
    """Queue it, promising its answer by ``answer_by`` (monotonic; inf: no promise); ``evict``: a queued long
    prompt given up to make room for it (the queues are full), or None."""
    answer_by: float
    evict: Eviction | None = None


class AdmissionPolicy(Protocol):
    """What the batcher asks (see the module doc); every call reads one fresh snapshot and changes nothing."""

    def decide(self, tokens: int, view: Snapshot, held: float = 0.0) -> Admit | Refusal:
        """A prepared request of ``tokens`` prompt tokens arrives. ``held``: tokens of bodies still being
        prepared that will queue ahead of it (Admission's holds)."""

    def unread(self, estimates: Sequence[int], view: Snapshot, held: float) -> Refusal | None:
        """The check before a body is read: ``estimates`` are its prompt tokens (lowest, guess, highest: the
        BodySizer's; empty when it has none); ``held`` as in ``decide``. None lets the body be read and
        prepared."""

    def late(self, view: Snapshot) -> list[Eviction]:
        """Between device steps: the queued long prompts to refuse now."""


# What ServiceConfig.admission holds: a callable that builds the policy from the configured budgets.
PolicyFactory = Callable[[Budgets], AdmissionPolicy]


class CostPolicy:
    """Admission by cost (the module doc): ``budgets`` is the wait a request of each size may be admitted into."""

    def __init__(self, budgets: Budgets):
        self._budgets = budgets

    def decide(self, tokens: int, view: Snapshot, held: float = 0.0) -> Admit | Refusal:
        refused = self.refusal(tokens, view, held)
        if refused is not None:
            return refused
        evict = None
        if view.full:  # refusal() found a larger queued long prompt to give up instead
            victim = self._evictable(tokens, view)
            evict = self._eviction(victim, self.expected_wait(victim.tokens, view), view)
        return Admit(view.now + self.budget(tokens, view), evict)

    def unread(self, estimates: Sequence[int], view: Snapshot, held: float) -> Refusal | None:
        """Refused when a request of the body's estimated size would be refused at every size in the estimate's
        error span (a request it cannot judge is tokenized and checked exactly), or when the queue is full and
        holds nothing a request could displace."""
        if not estimates:
            return Refusal(Reason.QUEUE_FULL, 1, 0.0, 0.0) if view.full and not view.long else None
        refusals = [self.refusal(tokens, view, held) for tokens in estimates]
        return refusals[1] if all(refusals) else None

    def late(self, view: Snapshot) -> list[Eviction]:
        """Queued long prompts, in the order they would start, whose expected answer has moved past their
        promise by more than EVICT_SLACK of their budget (work passed them meanwhile): refused now rather than
        answered late. The promise is the later of the one made at admission
        and the budget the order gives a prompt of its size now (``budget``: what the shorter work passing its
        chunks makes it wait), so a prompt that a fresh one of its size would be admitted beside is kept, and
        a burst that follows a long prompt's admission does not turn it into a late 429. (The slack: whole
        prompts are taken a step at a time, so the work sorted before a long prompt swings by a step while it
        waits.)"""
        if not view.long:
            return []
        evicted: list[Eviction] = []
        kept: list[tuple[float, int]] = []   # the long prompts kept before this one
        for entry, key in sorted(view.long, key=lambda item: item[1]):
            wait = self._long_wait(entry.tokens, key, view, kept)
            promise = max(entry.answer_by, entry.enqueued_at + self.budget(entry.tokens, view))
            if view.now + wait > promise + EVICT_SLACK * (promise - entry.enqueued_at):
                evicted.append(self._eviction(entry, wait, view))
            else:
                kept.append((key, entry.tokens))
        return evicted

    def refusal(self, tokens: int, view: Snapshot, held: float = 0.0) -> Refusal | None:
        """Why a request of ``tokens`` prompt tokens would not be admitted, or None (``held``: as in
        expected_wait)."""
        budget = self.budget(tokens, view)
        wait = self.expected_wait(tokens, view, held)
        if view.full and self._evictable(tokens, view) is None:
            return Refusal(Reason.QUEUE_FULL, retry_after(wait, 0.0, self._budgets.max_s), wait, budget)
        if wait <= budget:
            return None
        return Refusal(Reason.QUEUED_WORK, retry_after(wait, budget, self._budgets.max_s), wait, budget)

    def budget(self, tokens: int, view: Snapshot) -> float:
        """The wait a request of ``tokens`` may be admitted into: its caller's tolerance, and never less than what
        the order alone can make it wait: one device step on each lane (a chunk, or the step running there now
        if longer), each lane's next chunk, and its own run, the lanes' share over all of them. For a prompt
        that runs chunked, what the order can make it wait while whole prompts keep coming (_long_wait): its own
        aging, and then still the step running and a chunk (whole prompts that came just before its key ran out,
        and a run's chunk, may go first), and a run that lets shorter work pass between its chunks."""
        n, rate, chunk = len(view.lanes), view.rate, view.chunk_tokens
        steps = sum(max(chunk, lane.step_tokens) for lane in view.lanes)
        if view.chunked(tokens):
            floor = (tokens / view.whole.age_rate + (steps + n * chunk) / (n * rate)
                     + tokens * self.slow(view) / rate)
        else:
            floor = (steps + n * chunk + n * tokens) / (n * rate)
        return max(self._budgets(tokens), floor)

    def slow(self, view: Snapshot) -> float:
        """How many times its own tokens' time chunked work takes while whole prompts keep coming: before each
        chunk runs the whole work queued when it became due, or if longer, what arrives within its aging (a
        chunk's tokens at the age rate: rate / age rate chunks' worth)."""
        return 1.0 + max(view.rate / view.whole.age_rate, view.whole.live_tokens / view.chunk_tokens)

    def expected_wait(self, tokens: int, view: Snapshot, held: float = 0.0) -> float:
        """Seconds to the answer of a request of ``tokens`` admitted now (the module doc): the work ahead of it
        over the lanes' rate, then its own run on one device. ``held``: tokens of bodies still being prepared
        that will queue ahead of it. A chunked one also waits for the shorter work that passes it
        (``_long_wait``)."""
        now = view.now
        key = view.whole.key(tokens, now)   # both queues age alike: a long prompt's key is the same
        if view.chunked(tokens):
            ahead = sorted((k, entry.tokens) for entry, k in view.long if k <= key)
            return self._long_wait(tokens, key, view, ahead, held)
        ahead = held + sum(_step_left(lane, view) for lane in view.lanes) + view.whole.tokens_before(key)
        chunk = view.chunk_tokens
        ahead += sum(min(chunk, lane.run_left) for lane in view.lanes if lane.chunk_key <= key)
        ahead += self._starting_before(key, view)
        # (ahead / n + tokens) / rate, written so that one lane computes exactly what one device did
        n = len(view.lanes)
        return (ahead + n * tokens) / (n * view.rate)

    def _long_wait(self, tokens: int, key: float, view: Snapshot, ahead: list[tuple[float, int]],
                   held: float = 0.0) -> float:
        """Seconds to the answer of a chunked prompt of ``tokens`` and order ``key`` (its arrival + its aging).
        Before it start the whole prompts whose keys come first (with what is left of the steps running and the
        ``held`` tokens of bodies being prepared), the rest of the runs started and the long prompts queued
        ahead (``ahead``: their keys and tokens, in order; a lane runs one at a time). Two cases, weighed by the
        share of time whole prompts wait: the recent share, and never less than the part of the first case's
        wait that the whole prompts queued now take to run (they wait that long at least; a burst that came
        since the last step ended has not moved the recent share yet, and a long prompt judged on that share
        alone was admitted, then evicted at the next step). None coming: all that runs, then its own
        run. Whole prompts coming all the time: shorter ones pass it until its key comes up, and pass every
        run between its chunks, its own too; so it starts at the latest of its key, the end of the whole prompts
        ahead of it, and the end of the runs before it (each of which starts no sooner than its own key)."""
        n, rate, slow, now = len(view.lanes), view.rate, self.slow(view), view.now
        whole = view.whole.tokens_before(key) + held + sum(_step_left(lane, view) for lane in view.lanes)
        started = sum(lane.run_left for lane in view.lanes if lane.run_left is not None)
        alone = (whole + started + sum(t for _, t in ahead)) / (n * rate) + tokens / rate
        runs_end = started * slow / (n * rate)
        for their_key, their_tokens in ahead:
            runs_end = max(runs_end, their_key - now) + their_tokens * slow / (n * rate)
        flowing = max(whole / (n * rate), runs_end, key - now) + tokens * slow / rate
        share = max(view.whole_share, min(1.0, view.whole.live_tokens / (n * rate) / alone))
        return (1 - share) * alone + share * flowing

    def _starting_before(self, key: float, view: Snapshot) -> float:
        """Tokens of first chunks of long prompts that start before a whole prompt of order ``key``: those
        whose keys come first, one on each lane that runs no chunked prompt."""
        free = sum(1 for lane in view.lanes if lane.run_left is None)
        if not free or not view.long:
            return 0.0
        first = sorted((k, entry.tokens) for entry, k in view.long if k <= key)[:free]
        return sum(min(view.chunk_tokens, tokens) for _, tokens in first)

    def _evictable(self, tokens: int, view: Snapshot) -> Entry | None:
        """The queued long prompt a full queue gives up for a request of ``tokens``: the largest, if
        larger."""
        victim = max((entry for entry, _ in view.long), key=lambda entry: entry.tokens, default=None)
        return victim if victim is not None and victim.tokens > tokens else None

    def _eviction(self, entry: Entry, wait: float, view: Snapshot) -> Eviction:
        """Refuse the queued long prompt ``entry``; ``wait``: the seconds to its answer, past its budget."""
        budget = self.budget(entry.tokens, view)
        return Eviction(entry, Refusal(Reason.EVICTED, retry_after(wait, budget, self._budgets.max_s), wait,
                                       budget))


def _step_left(lane: LaneView, view: Snapshot) -> float:
    """Tokens of the step on the lane's device that are not done yet, at the measured rate."""
    return max(0.0, lane.step_tokens - (view.now - lane.step_started) * view.rate)


class Admission:
    """Admission's one owner: the measured device rate, the body sizer, the bodies held while they are prepared,
    the recent share of time whole prompts waited, the policy and the refusal counter. The batcher asks it once a
    request is prepared (``admit``) and between steps (``late``), and tells it of every step (``on_step``); the
    Service asks it when a request arrives (``on_arrival``) and tells it once the body is prepared
    (``on_prepared``). Each question reads a fresh ``Snapshot``: the batcher's queues (``queues``) and what is
    measured here. Every refusal it answers, evictions included, is counted by reason and size class."""

    def __init__(self, policy: AdmissionPolicy, start_rate: float, queues: QueueSource, *, rejected: Counter,
                 held_tokens: Gauge, on_rate: Callable[[float], None]):
        """``start_rate``: the device rate (tokens/s) measured at start (``measured_rate``). ``rejected``: the
        refusal counter (labels: reason, size class); ``held_tokens``: the gauge of held bodies' tokens. ``on_rate``:
        called with the rate each time a step moved it."""
        self._policy = policy
        self._queues = queues
        self._rate = RateMeter(start_rate)
        self._on_rate = on_rate
        self._sizer = BodySizer()
        self._holds: set[Hold] = set()   # bodies past the arrival check, not yet queued
        self._whole_waiting = RecentShare()
        self._rejected = rejected
        self._held_tokens = held_tokens

    @property
    def rate(self) -> float:
        """The device rate, tokens/s per device: measured at start, then moved by every step (RateMeter)."""
        return self._rate.rate

    def snapshot(self, now: float | None = None) -> Snapshot:
        """What the policy reads at ``now`` (default: the clock's now)."""
        now = time.monotonic() if now is None else now
        queues = self._queues.queues()
        return Snapshot(now, self._rate.rate, queues.chunk_tokens, queues.whole, queues.long,
                        queues.lanes, self._whole_waiting.share(now), queues.full)

    def on_arrival(self, body_bytes: int | None) -> Hold | None:
        """The check before a body of ``body_bytes`` (None: unknown) is read: the policy's ``unread`` at the
        body's estimated sizes (BodySizer), counting the held bodies no larger as work ahead. Raises Refused;
        otherwise holds the body's estimated size until ``release`` (None: no estimate, nothing held)."""
        estimates = self._sizer.estimates(body_bytes)
        held = sum(h.tokens for h in self._holds if h.nbytes <= body_bytes) if estimates else 0
        refusal = self._policy.unread(estimates, self.snapshot(), held)
        if refusal is not None:
            raise self._refused(refusal, estimates[1] if estimates else None)
        if not estimates:
            return None
        hold = Hold(estimates[1], body_bytes)
        self._holds.add(hold)
        self._held_tokens.inc(hold.tokens)
        return hold

    def release(self, hold: Hold | None) -> None:
        """The held body is queued (``admit`` counts it from there) or given up; twice is harmless."""
        if hold in self._holds:
            self._holds.discard(hold)
            self._held_tokens.dec(hold.tokens)

    def on_prepared(self, hold: Hold | None, body_bytes: int | None, cost: int) -> None:
        """The body of ``hold`` is prepared and costs ``cost`` prompt tokens: its hold goes, and its size as a
        plain body (``body_bytes``; None: unknown) teaches the sizer."""
        self.release(hold)
        self._sizer.observe(body_bytes, cost)

    def admit(self, cost: int, now: float) -> Admit:
        """The policy's ``decide`` for a prepared request of ``cost`` at ``now``. Raises Refused; the eviction an
        Admit gives is counted here, and is the batcher's to carry out."""
        decision = self._policy.decide(cost, self.snapshot(now))
        if isinstance(decision, Refusal):
            raise self._refused(decision, cost)
        if decision.evict is not None:
            self._count(Reason.EVICTED, decision.evict.entry.tokens)
        return decision

    def queue_full(self, cost: int, budget_s: float) -> Refused:
        """A request of ``cost`` that its queue had no room for (the shipped policy never admits into a full
        queue; another may): its refusal, counted."""
        return self._refused(Refusal(Reason.QUEUE_FULL, 1, 0.0, budget_s), cost)

    def late(self, now: float) -> list[Eviction]:
        """Between steps: the queued long prompts the policy refuses now (``late``), counted."""
        evictions = self._policy.late(self.snapshot(now))
        for eviction in evictions:
            self._count(Reason.EVICTED, eviction.entry.tokens)
        return evictions

    def on_step(self, tokens: int, seconds: float, *, started: float, waiting_since: float | None,
                now: float) -> None:
        """A step of ``tokens`` that took ``seconds`` of device time, started at ``started``, ended at ``now``;
        whole prompts have been waiting since ``waiting_since`` (None: none waits). The waiting share counts
        the time since the later of the two (RecentShare caps what one step adds at the time since any lane's
        last step ended, so lanes whose steps overlap do not count the same wait twice)."""
        self._whole_waiting.step(now, now - max(started, waiting_since) if waiting_since is not None else 0.0)
        self._rate.observe(tokens, seconds)
        self._on_rate(self._rate.rate)

    def _refused(self, refusal: Refusal, tokens: int | None) -> Refused:
        self._count(refusal.reason, tokens)
        return Refused(refusal)

    def _count(self, reason: Reason, tokens: int | None) -> None:
        self._rejected.labels(reason.value, size_class(tokens)).inc()
