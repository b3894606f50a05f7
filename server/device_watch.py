"""Whether each device still answers: a call that runs far past its expected time (stalled), a device that fails
its self-check (faulted), and how long either lasts.

A stalled call is what a wedged GPU, a kernel that never ends or a hung driver look like from here: the device
process neither answers nor dies. A faulted device is one that fails every call, as a CUDA context does after an
illegal memory access: each request then fails alone with a DeviceError, and only the self-check that the
batcher runs after such a failure tells a failed device from a failed request.

The batcher reports every call on a device (``started``/``ended``) with its cost in tokens (its prompt tokens and
its images' vision towers at their ceiling, server/image_cost.py) and the measured rate; the call's limit is
``STALL_FACTOR`` times its expected time (cost over the rate), never under ``stall_timeout_s``: a step that is long
because its work is large (a big image's tower) gets a limit as long, while a call that hangs still runs past its
own. A device past its limit, or one whose self-check failed, is in trouble: ``on_change`` tells the Service, which
stops taking requests (``/health`` 503) and refuses the queued ones (503, another replica may answer them). Trouble
ends when the call ends or a later self-check passes (``on_change`` again). Trouble that lasts ``grace_s`` is given
up (``on_expired``): the Service kills the device process and fails, and ``clefcore serve`` exits non-zero to be
restarted. Each episode is one log line when it begins (``device_stalled`` / ``device_faulted``) and one when it
ends (``device_recovered`` / ``device_given_up``).

Lanes are named by their label (their place in --device), as the batcher's are.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from .logs import log
from .metrics import Metrics

# A call may take this many times its expected time before it counts as stalled: the rate is a smoothed mean,
# and one batch's time varies with its shape (many short prompts, images, a guard trip answered again exactly).
STALL_FACTOR = 4.0
# A faulted device runs its self-check again this often, and serves again once it passes.
RECHECK_S = 2.0

STALLED, FAULTED = "stalled", "faulted"
# clef_device_faults_total's kinds: a call past its limit, a failed self-check, a device process that ended
FAULT_KINDS = ("stall", "self_check", "lost")


@dataclass(frozen=True)
class Trouble:
    """One device's trouble: ``kind`` (stalled or faulted), what happened (``reason``, worded to follow "server is"
    in a 503), and when it was found (time.monotonic)."""
    lane: str
    kind: str
    reason: str
    since: float


class DeviceWatch:
    def __init__(self, metrics: Metrics, stall_timeout_s: float, grace_s: float,
                 on_change: Callable[[Trouble | None], None], on_expired: Callable[[Trouble], None]):
        """``on_change``: called with the first trouble (None: none) whenever a device's trouble begins or ends;
        ``on_expired``: called once per trouble that lasted ``grace_s``."""
        self._metrics = metrics
        self.stall_timeout_s = stall_timeout_s
        self.grace_s = grace_s
        self._on_change = on_change
        self._on_expired = on_expired
        self._limits: dict[str, asyncio.TimerHandle] = {}   # the call on each lane's device, until its limit
        self._late: set[str] = set()                         # lanes whose call is past its limit
        self._troubles: dict[str, Trouble] = {}
        self._graces: dict[str, asyncio.TimerHandle] = {}
        self._given_up: set[str] = set()
        self._closed = False
        for kind in FAULT_KINDS:   # every series from the start, at 0: an alert on its increase needs two points
            metrics.device_faults.labels(kind)
        metrics.device_stalled.set(0)

    @property
    def trouble(self) -> Trouble | None:
        """The earliest trouble of any device, or None when every device answers."""
        return min(self._troubles.values(), key=lambda t: t.since, default=None)

    def limit_s(self, tokens: int, rate: float) -> float:
        """How long a call costing ``tokens`` (prompt tokens, images at their towers' cost) may run on a device of
        ``rate`` tokens/s."""
        return max(self.stall_timeout_s, STALL_FACTOR * tokens / rate)

    # --- what the batcher reports ---------------------------------------------------------------------------
    def started(self, lane: str, what: str, tokens: int, rate: float) -> None:
        """A call (``what``: forward, chunk step, self-check, drop) of ``tokens`` went to the lane's device."""
        if self._closed:
            return
        limit = self.limit_s(tokens, rate)
        _cancel(self._limits.pop(lane, None))
        self._limits[lane] = asyncio.get_running_loop().call_later(limit, self._stalled, lane, what, tokens, limit)

    def ended(self, lane: str) -> None:
        """The lane's call came back (answered, failed, or its process gone)."""
        _cancel(self._limits.pop(lane, None))
        if lane in self._late:
            self._late.discard(lane)
            self._metrics.device_stalled.set(1 if self._late else 0)
        trouble = self._troubles.get(lane)
        if trouble is not None and trouble.kind == STALLED:
            self._clear(lane)

    def faulted(self, lane: str, error: str) -> None:
        """The lane's device failed its self-check with ``error`` (counted once while it stays faulted)."""
        self._found(lane, FAULTED, f"faulted: device {lane} failed its self-check ({error})", "self_check")

    def checked(self, lane: str) -> None:
        """The lane's device passed its self-check: a fault found before is over."""
        if lane in self._troubles:
            self._clear(lane)

    def lost(self) -> None:
        """A device process ended by itself (the Service fails at once: there is nothing to wait for)."""
        self._metrics.device_faults.labels("lost").inc()

    def close(self) -> None:
        """The service is stopping: no more judgements, and no timer left behind."""
        self._closed = True
        for handle in (*self._limits.values(), *self._graces.values()):
            handle.cancel()
        self._limits.clear()
        self._graces.clear()

    # --- the judgements ----------------------------------------------------------------------------------------
    def _stalled(self, lane: str, what: str, tokens: int, limit: float) -> None:
        self._limits.pop(lane, None)
        self._late.add(lane)
        self._metrics.device_stalled.set(1)
        call = f"{what} of {tokens} tokens" if tokens else what
        self._found(lane, STALLED, f"stalled: device {lane}'s {call} has run past its {limit:.3g} s limit", "stall")

    def _found(self, lane: str, kind: str, reason: str, fault: str) -> None:
        if self._closed or lane in self._troubles:   # one count and one line per episode
            return
        self._metrics.device_faults.labels(fault).inc()
        self._troubles[lane] = Trouble(lane, kind, reason, time.monotonic())
        self._graces[lane] = asyncio.get_running_loop().call_later(self.grace_s, self._expired, lane)
        log(f"device_{kind}", level="error", lane=lane, reason=reason, grace_s=self.grace_s)
        self._on_change(self.trouble)

    def _clear(self, lane: str) -> None:
        if self._closed or lane in self._given_up:   # its process is being killed: this is no recovery
            return
        trouble = self._troubles.pop(lane)
        _cancel(self._graces.pop(lane, None))
        log("device_recovered", lane=lane, was=trouble.kind, after_s=round(time.monotonic() - trouble.since, 3))
        self._on_change(self.trouble)

    def _expired(self, lane: str) -> None:
        self._graces.pop(lane, None)
        trouble = self._troubles[lane]
        self._given_up.add(lane)
        log("device_given_up", level="error", lane=lane, reason=trouble.reason, after_s=self.grace_s)
        self._on_expired(trouble)


def _cancel(handle: asyncio.TimerHandle | None) -> None:
    if handle is not None:
        handle.cancel()
