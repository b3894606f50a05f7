"""What a prompt's length costs the device, and the longest prompt a deployment takes.

Every token of a prompt attends to all the tokens before it in the full-attention layers, so a chunk of a long
prompt takes longer the further into the prompt it lies, and a chunk of a long prompt, which carries the state of
those before it, costs more a token than the packed forwards of short prompts that the rate is measured on. On a
CPU a prompt of the whole context ran several times longer than its tokens over that rate. So at start the device
also runs one synthetic prompt chunked, as a long request runs, in CONTEXT_CHUNKS chunks of the auto chunk size
and one token more, and a chunk's time a token is fitted as a line in its offset, through the chunks but the
first (its warm-up) and the last (one token and the head): ``per_token`` seconds at the start of a prompt, and
``per_token_pair`` more for each token before it. A prompt of T tokens then takes about
per_token * T + per_token_pair * T^2 / 2 seconds. Where the limit below bites, the run is repeated and each chunk
counted at its faster time: a chunk slowed by something else would otherwise refuse prompts the device runs in
time.

The longest prompt the server takes (``--max-prompt-tokens``, auto) is the longest whose own run fits the longest
wait any prompt tolerates (``--max-queue-wait``, or ``--min-queue-wait`` if larger): a longer one would hold the
device past every budget even alone, and time out, so it is refused with 413 at once instead. Where the device
runs the whole context within that wait (a GPU, by far), the context length is the only bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from clefcore.errors import PromptTokensError

# Whole chunks of the synthetic prompt run at start: the first pays for its warm-up, so the line is fitted
# through the other five (the further they reach into the context, the less a long prompt's cost is an
# extrapolation, and the longer a start takes).
CONTEXT_CHUNKS = 6
# Runs of it at most: a second where the first one's limit bites, each chunk then counted at its faster time.
PROMPT_RUNS = 2


@dataclass(frozen=True)
class PromptCost:
    """A prompt's device seconds from its length: ``per_token`` seconds a token, ``per_token_pair`` more for each
    token before it (see the module doc)."""
    per_token: float
    per_token_pair: float

    def __post_init__(self):
        if not (self.per_token > 0 and self.per_token_pair >= 0):
            raise ValueError(f"a prompt cost needs a token cost > 0 and a pair cost >= 0, got {self.per_token}, "
                             f"{self.per_token_pair}")

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, int, float]]) -> "PromptCost":
        """From warm chunks of one run (``samples``: (offset, tokens, seconds) each): the least-squares line of a
        chunk's time per token in its offset, less the pairs within a chunk (its tokens attend to one another too:
        at its middle, half a chunk each), which the square counts. Noise that makes the line fall counts no
        growth (the chunks' mean time a token); noise that puts it under zero at the start counts the fastest
        chunk's time a token there."""
        steps = list(samples)
        if len(steps) < 2:
            raise ValueError(f"the growth needs at least two timed chunks, got {samples}")
        xs = [offset for offset, _, _ in steps]
        ys = [seconds / tokens for _, tokens, seconds in steps]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        spread = sum((x - mx) ** 2 for x in xs)
        if not spread > 0:
            raise ValueError(f"the timed chunks need different offsets, got {xs}")
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / spread)
        start = my - slope * (mx + sum(tokens for _, tokens, _ in steps) / len(steps) / 2)
        return cls(start if start > 0 else min(ys), slope)

    def seconds(self, tokens: int) -> float:
        """The device seconds of one prompt of ``tokens`` tokens."""
        return self.per_token * tokens + self.per_token_pair * tokens * tokens / 2

    def longest(self, seconds: float) -> int:
        """The most tokens of a prompt whose run takes at most ``seconds``."""
        a, b = self.per_token_pair / 2, self.per_token
        tokens = int((-b + math.sqrt(b * b + 4 * a * seconds)) / (2 * a)) if a > 0 else int(seconds / b)
        while tokens > 0 and self.seconds(tokens) > seconds:   # the root's rounding
            tokens -= 1
        return tokens


@dataclass(frozen=True)
class PromptLimit:
    """The longest prompt the server takes (``tokens``), what its device's prompts cost (``cost``), and the
    seconds an auto limit fits a run in (``budget_s``; None: a configured limit, which no run's pace changes)."""
    tokens: int
    cost: PromptCost
    budget_s: float | None = None

    @classmethod
    def sized(cls, configured: int | None, cost: PromptCost, budget_s: float, context_length: int) -> "PromptLimit":
        """``configured`` tokens, or where None (auto) the longest prompt whose run fits ``budget_s`` (module doc);
        never above ``context_length``, which cuts or refuses longer prompts first."""
        if configured is not None:
            return cls(max(1, min(configured, context_length)), cost)
        return cls(max(1, min(cost.longest(budget_s), context_length)), cost, budget_s)

    def overrun(self, tokens: int, done: int, seconds: float,
                chunks: Sequence[tuple[int, int, float]] = ()) -> PromptTokensError | None:
        """Judged while a prompt of ``tokens`` runs chunked, ``done`` of them in ``seconds`` of device time: the
        refusal when its whole run would pass the budget, at its pace so far (never counted faster than ``cost``
        says) or, once four of its own ``chunks`` ((offset, tokens, seconds) each) are timed, at the line through
        them but the first, or through their recent half (a CPU's growth steepens as a prompt outgrows its caches,
        which a line fitted at start on the first chunks of a prompt misses, and a line through all of them
        lags). An estimate of a long prompt's cost is an extrapolation, and a
        run that shows it was too low is stopped here, within the budget, rather than holding the device until
        its deadline."""
        if self.budget_s is None or not 0 < done < tokens:
            return None
        pace = max(1.0, seconds / self.cost.seconds(done))
        rest = pace * (self.cost.seconds(tokens) - self.cost.seconds(done))
        if len(chunks) >= 4 and all(a[0] < b[0] for a, b in zip(chunks, chunks[1:])):   # none re-run
            warm = list(chunks[1:])
            for own in (PromptCost.fit(warm), PromptCost.fit(warm[-max(3, len(warm) // 2):])):   # and its recent half
                rest = max(rest, own.seconds(tokens) - own.seconds(done))
        whole = seconds + rest
        if whole <= self.budget_s:
            return None
        return PromptTokensError(
            f"prompt is {tokens} tokens, about {whole:.3g} s of this server's device at the pace of its first {done}, "
            f"over the {self.budget_s:.3g} s any prompt may take; send a shorter state", field="state",
            limit=f"{self.budget_s:.3g} s of device time")

    def check(self, tokens: int) -> None:
        """PromptTokensError for a prompt of ``tokens`` over the limit."""
        if tokens > self.tokens:
            raise PromptTokensError(
                f"prompt is {tokens} tokens, about {self.cost.seconds(tokens):.3g} s of this server's device; it "
                f"takes prompts of at most {self.tokens} tokens (--max-prompt-tokens): send a shorter state",
                field="state", limit=f"{self.tokens} tokens")
