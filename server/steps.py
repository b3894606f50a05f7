"""How many prompt tokens one device step may take: a packed batch (--max-batch-tokens) or a long prompt's chunk
(--chunk-tokens). Images count at their vision towers' cost in tokens (server/image_cost.py), so a step of
image work is bounded in time like one of text.

A fixed number stays what it is. ``auto`` (None) is the largest step that takes ``budget_s`` of device time at the
rate the service measures (server/admission.py's RateMeter: once at start, then after every step), never below
STEP_FLOOR_TOKENS and never above STEP_CAP_TOKENS, the size the device memory is reserved for
(ServiceConfig.reserve_limits). A short request waits for about one step ahead of it, so a step bounded in time
bounds that wait on any device; a fixed number of tokens is a few milliseconds on one device and seconds on
another.
"""

from __future__ import annotations

from dataclasses import dataclass

from clefcore.options import STEP_CAP_TOKENS, STEP_FLOOR_TOKENS


@dataclass(frozen=True)
class StepSize:
    """One step limit: ``fixed`` tokens, or None for auto (``budget_s`` seconds at the measured rate)."""
    fixed: int | None
    budget_s: float

    def __post_init__(self):
        if not self.budget_s > 0:
            raise ValueError(f"step budget must be > 0 s, got {self.budget_s}")

    def at(self, rate: float) -> int:
        """The limit in tokens while the device runs ``rate`` prompt tokens per second."""
        if self.fixed is not None:
            return self.fixed
        return int(min(STEP_CAP_TOKENS, max(STEP_FLOOR_TOKENS, rate * self.budget_s)))
