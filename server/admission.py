"""Admission by cost: the numbers behind a 429 (server/batcher.py applies them).

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
time in which whole prompts were waiting: when none come, the whole prompts ahead of it, the runs and long
prompts before it, then its own run; when they keep coming, shorter ones pass it until its key comes up and
between the chunks of every run, so it starts at the latest of its key, the end of the whole work sorted before
it and the end of the runs before it, and runs slower than its tokens by what passes each chunk. A queued long
prompt whose expected answer moves well past its promise is refused then (evicted). So when the device cannot
keep up, the most expensive requests are the ones refused, and a short one is refused only when short work
alone exceeds what the device does.

The first check, before a body is read, takes the body's size as tokens (BodySizer) and adds the bodies that
passed it earlier and are still being read and tokenized, those no larger in bytes, as work ahead (the
batcher's holds): they will be queued before it.

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
from collections import deque
from dataclasses import dataclass

# Guesses that size the forward measuring the rate at start: the H200 packs ~24k prompt tokens/s on clef-flash;
# the CPU path serves the tiny test model at a few thousand.
START_RATE = {"cpu": 2_000.0, "cuda": 20_000.0}
# Weight of one forward of `_HALF_TOKENS` tokens in the mean; larger forwards weigh more, up to 0.5.
_HALF_TOKENS = 8_192
_MAX_WEIGHT = 0.5
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
    """Tokens per second of device time, smoothed."""

    def __init__(self, start: float):
        if not start > 0:
            raise ValueError(f"start rate must be > 0 tokens/s, got {start}")
        self.rate = float(start)
        self.samples = 0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not seconds > 0:
            return
        sample = tokens / seconds
        weight = min(_MAX_WEIGHT, 0.25 * tokens / _HALF_TOKENS) if self.samples else 1.0
        weight = max(weight, 0.05)
        self.rate += weight * (sample - self.rate)
        self.samples += 1


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
    """Why a request is not admitted; ``retry_after_s`` is whole seconds, as the header wants."""
    reason: str  # "queued_work", "queue_full" or "evicted" (admitted, then displaced by cheaper work)
    retry_after_s: int
    wait_s: float          # expected wait had it been admitted (or kept)
    budget_s: float


def retry_after(wait_s: float, budget_s: float, cap_s: float) -> int:
    """Whole seconds until the expected wait fits the budget again: at least 1, at most ``cap_s``."""
    over = wait_s - budget_s
    return max(1, math.ceil(min(over, cap_s))) if not math.isnan(over) else 1


def size_class(tokens: int | None) -> str:
    """The refusal counter's label for a prompt of ``tokens`` (None: not known, a body refused unread whose
    size could not be estimated)."""
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
