"""Admission by work: how long the work already accepted will keep the device busy, and whether one more
request fits the wait budget.

The device's rate (prompt tokens per second) is measured as it serves: an exponentially weighted mean over
forwards and chunk steps, weighted by their tokens so that a tiny batch's fixed overhead does not swing it.
Until the first forwards it is a start value per device kind.

A request's expected time to its answer is the work that will run before it (tokens, over that rate) plus its
own. Its budget grows with its own size: ``slowdown`` times its own device time, at least MIN_BUDGET_S, at most
the cap (``--max-queue-wait``). A one-second prompt may so wait a few seconds, while a short decision is only
admitted where it can be answered in a fraction of a second; past that it gets a 429 it can act on at once,
instead of a long wait that looks the same to its caller as a dead server.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Start values, replaced by the measured rate within a few forwards: the H200 packs ~24k prompt tokens/s on
# clef-flash; the CPU path serves the tiny test model at a few thousand.
START_RATE = {"cpu": 2_000.0, "cuda": 20_000.0}
# Weight of one forward of `_HALF_TOKENS` tokens in the mean; larger forwards weigh more, up to 0.5.
_HALF_TOKENS = 8_192
_MAX_WEIGHT = 0.5


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


@dataclass(frozen=True)
class Refusal:
    """Why a request is not admitted; ``retry_after_s`` is whole seconds, as the header wants."""
    reason: str            # "queued_work" or "queue_full"
    retry_after_s: int
    wait_s: float          # expected wait had it been admitted
    budget_s: float


# Below this a device step's own length dominates the estimate's error: no budget is tighter.
MIN_BUDGET_S = 0.25


def budget(own_tokens: int, rate: float, slowdown: float, cap_s: float) -> float:
    """Seconds to its answer a request of ``own_tokens`` may be admitted into (see the module doc)."""
    if math.isinf(slowdown):
        return cap_s
    return min(cap_s, max(MIN_BUDGET_S, slowdown * own_tokens / rate))


def expected_wait(backlog_tokens: int, rate: float) -> float:
    return backlog_tokens / rate if backlog_tokens > 0 else 0.0


def retry_after(backlog_tokens: int, rate: float, budget_s: float) -> int:
    """Seconds until the backlog has drained to what fits the budget again, at least 1."""
    over = expected_wait(backlog_tokens, rate) - budget_s
    return max(1, math.ceil(over)) if math.isfinite(over) else 1


def check(backlog_tokens: int, own_tokens: int, rate: float, budget_s: float) -> Refusal | None:
    """None when a request of ``own_tokens`` may be admitted behind ``backlog_tokens`` of work that runs before
    it. With nothing ahead it is always admitted (a prompt longer than the budget would otherwise never run);
    the budget bounds the time to its own answer: the work ahead of it plus itself."""
    if backlog_tokens <= 0:
        return None
    wait = expected_wait(backlog_tokens + own_tokens, rate)
    if wait <= budget_s:
        return None
    return Refusal("queued_work", retry_after(backlog_tokens + own_tokens, rate, budget_s), wait, budget_s)


class BodySizer:
    """Prompt tokens from a body's size, at the bytes per token of recent requests (smoothed): the estimate the
    admission check uses before a body is read and tokenized, so that shedding load costs no parsing."""

    def __init__(self):
        self.bytes_per_token: float | None = None

    def observe(self, nbytes: int | None, tokens: int) -> None:
        if not nbytes or tokens <= 0:
            return
        sample = nbytes / tokens
        self.bytes_per_token = sample if self.bytes_per_token is None else (
            self.bytes_per_token + 0.1 * (sample - self.bytes_per_token))

    def estimates(self, nbytes: int | None) -> tuple[int, ...]:
        """Token counts spanning the estimate's error (half to twice it); empty until a request was measured."""
        if not nbytes or self.bytes_per_token is None:
            return ()
        guess = nbytes / self.bytes_per_token
        return tuple(max(1, round(guess * f)) for f in (0.5, 1.0, 2.0))
