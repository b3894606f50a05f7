"""What a prompt's length costs the device beyond its tokens, and the longest prompt a deployment takes.

Every token of a prompt attends to all the tokens before it in the full-attention layers, so a chunk of a long
prompt takes longer the further into the prompt it lies. The rate measured at start (a packed forward of short
prompts) does not see that growth: on a CPU a prompt of the whole context ran several times longer than its
tokens over that rate, its last chunks many times the first. So at start the device also runs one synthetic prompt chunked,
as a long request runs, in CONTEXT_CHUNKS chunks of the auto chunk size and one token more, and the growth of a
chunk's time with its offset is fitted through the chunks but the first (its warm-up) and the last (one token
and the head): ``per_token_pair`` seconds for each of a chunk's tokens times each token before it. Where the
limit below bites, the run is repeated and each chunk counted at its faster time: a chunk slowed by something
else would otherwise refuse prompts the device runs in time. A prompt of T tokens then takes about
T / rate + per_token_pair * T^2 / 2 seconds, however it is chunked.

The longest prompt the server takes (``--max-prompt-tokens``, auto) is the longest whose own run fits the longest
wait any prompt tolerates (``--max-queue-wait``, or ``--min-queue-wait`` if larger): a longer one would hold the
device past every budget even alone, and time out, so it is refused with 413 at once instead. Where the device runs the whole
context within that wait (a GPU, by far), the context length is the only bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from clefcore.errors import PromptTokensError

# Whole chunks of the synthetic prompt run at start: the first pays for its warm-up, so the growth is fitted
# through the other three.
CONTEXT_CHUNKS = 4
# Runs of it at most: a second where the first one's limit bites, each chunk then counted at its faster time.
PROMPT_RUNS = 2


@dataclass(frozen=True)
class PromptCost:
    """A prompt's device seconds from its length: ``rate`` tokens/s plus ``per_token_pair`` (see the module
    doc)."""
    rate: float
    per_token_pair: float

    def __post_init__(self):
        if not (self.rate > 0 and self.per_token_pair >= 0):
            raise ValueError(f"a prompt cost needs a rate > 0 and a pair cost >= 0, got {self.rate}, "
                             f"{self.per_token_pair}")

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, int, float]], rate: float) -> "PromptCost":
        """From warm chunks of one run (``samples``: (offset, tokens, seconds) each): the least-squares slope of a
        chunk's time per token against its offset. Noise that makes it negative counts no growth."""
        steps = list(samples)
        if len(steps) < 2:
            raise ValueError(f"the growth needs at least two timed chunks, got {samples}")
        xs = [offset for offset, _, _ in steps]
        ys = [seconds / tokens for _, tokens, seconds in steps]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        spread = sum((x - mx) ** 2 for x in xs)
        if not spread > 0:
            raise ValueError(f"the timed chunks need different offsets, got {xs}")
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / spread
        return cls(rate, max(0.0, slope))

    def seconds(self, tokens: int) -> float:
        """The device seconds of one prompt of ``tokens`` tokens."""
        return tokens / self.rate + self.per_token_pair * tokens * tokens / 2

    def longest(self, seconds: float) -> int:
        """The most tokens of a prompt whose run takes at most ``seconds``."""
        a, b = self.per_token_pair / 2, 1 / self.rate
        tokens = int((-b + math.sqrt(b * b + 4 * a * seconds)) / (2 * a)) if a > 0 else int(seconds * self.rate)
        while tokens > 0 and self.seconds(tokens) > seconds:   # the root's rounding
            tokens -= 1
        return tokens


@dataclass(frozen=True)
class PromptLimit:
    """The longest prompt the server takes (``tokens``), and what its device's prompts cost (``cost``)."""
    tokens: int
    cost: PromptCost

    @classmethod
    def sized(cls, configured: int | None, cost: PromptCost, budget_s: float, context_length: int) -> "PromptLimit":
        """``configured`` tokens, or where None (auto) the longest prompt whose run fits ``budget_s`` (module doc);
        never above ``context_length``, which cuts or refuses longer prompts first."""
        tokens = cost.longest(budget_s) if configured is None else configured
        return cls(max(1, min(tokens, context_length)), cost)

    def check(self, tokens: int) -> None:
        """PromptTokensError for a prompt of ``tokens`` over the limit."""
        if tokens > self.tokens:
            raise PromptTokensError(
                f"prompt is {tokens} tokens, about {self.cost.seconds(tokens):.3g} s of this server's device; it "
                f"takes prompts of at most {self.tokens} tokens (--max-prompt-tokens): send a shorter state",
                field="state", limit=f"{self.tokens} tokens")
