"""The model in a process of its own: load, self-check, packed forwards and chunk steps.

Why a process and not a thread: the event loop (HTTP parsing, admission, every 429) and the device loop (a
forward launches hundreds of kernels from Python) would share one GIL. Under a storm of clients that resend at
once after a 429, the loop held it ~14x as long as the device thread did, and the device sat idle between
launches (docs/bench/2026-12-04-h200-overload-three-behaviours/). Here the device process has a GIL of its own; the
server's process keeps the HTTP side, the tokenizer (clefcore/preparer.py) and the scheduling (batcher.py).

The two talk over one pipe. The server sends ``(op, args)``; the device process runs the calls one at a time,
in order, and answers each with ``(ok, value or error, EngineStatus)``, so the server's view of the engine
(precision fallbacks, device memory) is as fresh as its last call. A chunked prompt's state stays in the
device process: ``step`` with a prepared request starts one (dropping any earlier one), ``step`` with None
runs its next chunk; each step is as long as the server says (its step size follows the device's rate).

The device process ignores SIGINT and SIGTERM: the server drains on them and then sends ``stop``. It ends by
itself when the pipe closes (the server is gone). If it dies (killed for memory, a crash), every
waiting call fails with DeviceError and ``on_lost`` tells the server, which then exits non-zero. ``kill`` ends one
that no longer answers (server/device_watch.py gave it up) the same way, without ``on_lost``.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle
import signal
import threading
import time
from collections import deque
from typing import Any, Callable, NamedTuple

import numpy as np

from clefcore.engine import Engine, EngineStatus, padded, tower_embeds
from clefcore.example_request import support_ticket
from clefcore.errors import DeviceError
from clefcore.options import EngineOptions
from clefcore.preparer import Prepared
from clefcore.preprocess import PATCH, pixels

from .testhooks import TestHooks

# A device process that does not end within this long of its pipe closing (it is in a forward that a drain
# timeout left running) is killed.
STOP_GRACE_S = 5.0

BatchResults = list[tuple[dict | None, Exception | None]]


class Step(NamedTuple):
    """One chunk step of a chunked prompt."""
    done: bool
    response: dict | None         # when done without error
    tokens: int                   # prompt tokens this step processed
    tokens_left: int              # grows back when a guard trip restarts the run on the exact path
    error: Exception | None       # this request alone failed
    seconds: float                # device time of the step
    images_left: int = 0          # images not yet through the vision tower (grow back as tokens_left does)


class DeviceProcess:
    def __init__(self, hooks: TestHooks, name: str = "clef-device"):
        ctx = multiprocessing.get_context("spawn")   # never fork a process with threads and an event loop
        self._conn, child = ctx.Pipe(duplex=True)
        self._process = ctx.Process(target=_serve, args=(child, hooks), name=name, daemon=True)
        self._process.start()
        child.close()
        self._waiting: deque[asyncio.Future] = deque()
        self._reader: threading.Thread | None = None
        self._lost: str | None = None
        self._closing = False
        self.status: EngineStatus | None = None   # the engine's, as of the last answered call
        self.on_lost: Callable[[str], None] | None = None

    # --- the calls --------------------------------------------------------------------------------------
    async def load(self, path: str, revision: str | None, device: str, options: EngineOptions,
                   reserve: dict) -> EngineStatus:
        """``clefcore.load(path, device, options, revision=revision)`` in the device process, then
        ``Engine.reserve(**reserve)``: the device memory of the largest batch and chunked prompt, held from now
        on."""
        await self._call("load", path, revision, device, options, reserve)
        return self.status

    async def self_check(self) -> None:
        await self._call("self_check")

    async def measure(self, tokens: int) -> tuple[int, float]:
        """The device's rate at start: a packed forward of about ``tokens`` synthetic prompt tokens, run twice;
        its tokens and the second (warm) run's device seconds."""
        return await self._call("measure", tokens)

    async def measure_tower(self, sides: tuple[int, ...]) -> list[tuple[int, float]]:
        """The vision tower's device time at start: one synthetic square image of each of ``sides`` pixels, run
        twice; (patches, the faster run's device seconds) each. Empty when the engine answers no images."""
        return await self._call("measure_tower", sides)

    async def infer(self, prepared: list[Prepared]) -> tuple[BatchResults, float]:
        """One packed forward: a (response, error) pair per request (a failing batch is retried request by
        request, so only the failing ones carry an error), and the forward's device seconds."""
        return await self._call("infer", prepared)

    async def step(self, prepared: Prepared | None, tokens: int, images: int = 0) -> Step:
        """The next chunk, of ``tokens`` tokens, of the running chunked prompt (``prepared`` starts a new one);
        with ``images`` > 0 while its images are not all through the vision tower, the tower of the next
        ``images`` of them instead."""
        return await self._call("step", prepared, tokens, images)

    async def drop(self) -> None:
        """Free the chunked prompt's state (its client left)."""
        await self._call("drop")

    @property
    def lost(self) -> str | None:
        """Why the process is gone (its calls fail with DeviceError), or None while it runs."""
        return self._lost

    def kill(self, reason: str) -> None:
        """End the process now (it stopped answering, or fails every call) and fail the calls waiting on it with
        DeviceError(``reason``). ``on_lost`` is not called: the caller knows."""
        if self._lost is None:
            self._process.kill()
            self._fail_waiting(reason)

    async def stop(self) -> None:
        """Ask the process to end after the call it is running, and wait (killed after STOP_GRACE_S)."""
        self._closing = True
        try:
            self._conn.send_bytes(pickle.dumps(("stop", ())))
        except OSError:    # it is gone already
            pass
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._process.join, STOP_GRACE_S)
        if self._process.is_alive():
            self._process.kill()
            await loop.run_in_executor(None, self._process.join)
        if self._reader is not None:   # it ends at the closed pipe's EOF
            await loop.run_in_executor(None, self._reader.join, STOP_GRACE_S)
        self._conn.close()

    # --- the pipe -------------------------------------------------------------------------------------
    def _call(self, op: str, *args: Any) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if self._lost is not None:
            future.set_exception(DeviceError(self._lost))
            return future
        message = pickle.dumps((op, args), protocol=pickle.HIGHEST_PROTOCOL)   # raises before anything is sent
        if self._reader is None:
            self._reader = threading.Thread(target=self._read, args=(loop,), name="clef-device-replies", daemon=True)
            self._reader.start()
        try:
            self._conn.send_bytes(message)
        except OSError as error:   # the process died since its last reply, before the reader saw the pipe's end
            reason = f"the device process is gone ({type(error).__name__})"
            self._fail(reason)
            future.set_exception(DeviceError(reason))
            return future
        self._waiting.append(future)
        return future

    def _read(self, loop: asyncio.AbstractEventLoop) -> None:
        """Reader thread: each reply to the loop as it arrives. A thread, not loop.add_reader: that would make
        the pipe non-blocking, and a send of a large batch (images) would then fail half-written."""
        while True:
            try:
                reply = self._conn.recv()
            except (EOFError, OSError):
                self._process.join(1.0)
                reason = f"the device process exited (code {self._process.exitcode})"
                try:
                    loop.call_soon_threadsafe(self._fail, reason)
                except RuntimeError:   # the loop is closed: the server has exited
                    pass
                return
            try:
                loop.call_soon_threadsafe(self._answered, *reply)
            except RuntimeError:
                return

    def _answered(self, ok: bool, value: Any, status: EngineStatus | None) -> None:
        self.status = status
        future = self._waiting.popleft()
        if future.done():          # its caller was cancelled meanwhile
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def _fail(self, reason: str) -> None:
        # stop() closed the pipe: an ending, not a loss; kill() ended it and failed the calls already
        if self._closing or self._lost is not None:
            return
        self._fail_waiting(reason)
        if self.on_lost is not None:
            self.on_lost(reason)

    def _fail_waiting(self, reason: str) -> None:
        self._lost = reason
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_exception(DeviceError(reason))


# --- the device process ----------------------------------------------------------------------------------

class _Device:
    """What runs in the device process: the engine, the chunked prompt in progress, the test hooks."""

    def __init__(self, hooks: TestHooks):
        self.hooks = hooks
        self.engine: Engine | None = None
        self.run = None     # the chunked prompt's clefcore.engine.ChunkedRun
        self.broken = False  # the sticky test fault has struck: every call fails

    def load(self, path: str, revision: str | None, device: str, options: EngineOptions, reserve: dict) -> None:
        import clefcore
        self.engine = clefcore.load(path, device, options, revision=revision)
        self.engine.reserve(**reserve)

    def self_check(self) -> None:
        self._broken()
        self.engine.self_check()

    def measure(self, tokens: int) -> tuple[int, float]:
        # Two prompts, not one: a single short prompt would replay (and first capture) a CUDA graph, which a
        # synthetic shape should not take a place among the cached ones for.
        base = self.engine.prepare(support_ticket())
        half = padded(base, min(max(base.num_tokens, tokens // 2), self.engine.host.context_length))
        batch = [half, half]
        self._infer(batch)                  # the first run of a shape pays for its warm-up
        started = time.perf_counter()
        self._infer(batch)
        return 2 * half.num_tokens, time.perf_counter() - started

    def measure_tower(self, sides: tuple[int, ...]) -> list[tuple[int, float]]:
        engine = self.engine
        if engine.vision is None:
            return []
        noise = np.random.default_rng(0)
        samples = []
        for side in sides:
            image = pixels(noise.integers(0, 256, (side, side, 3), dtype=np.uint8))
            runs = []
            for _ in range(2):        # the first run of a size pays for its warm-up (kernels, GEMM autotuning)
                started = time.perf_counter()
                # outside the forwards' window (Engine.on_device): its activations are not counted as a request's
                # overflow of the reserved memory; never a graph: real images' sizes keep the places among them
                engine.ops.to_host(tower_embeds(engine.ops, engine.vision, [image], replay=False))   # waits
                runs.append(time.perf_counter() - started)
            samples.append((side // PATCH * (side // PATCH), min(runs)))
        return samples

    def infer(self, prepared: list[Prepared]) -> tuple[BatchResults, float]:
        started = time.perf_counter()
        try:
            results = [(response, None) for response in self._infer(prepared)]
        except Exception as batch_error:  # noqa: BLE001 - a device failure is isolated below
            if len(prepared) == 1:
                results = [(None, _as_device_error(batch_error))]
            else:
                results = []
                for one in prepared:
                    try:
                        results.append((self._infer([one])[0], None))
                    except Exception as error:  # noqa: BLE001 - this request alone fails
                        results.append((None, _as_device_error(error)))
        return results, time.perf_counter() - started

    def step(self, prepared: Prepared | None, tokens: int, images: int = 0) -> Step:
        started = time.perf_counter()
        try:
            if prepared is not None:
                self.run = None                      # free the last run's state first
                self.run = self.engine.chunked(prepared, tokens)
            run = self.run
            before = run.tokens_left
            self._hooks([run.prepared], 0 if images and run.images_left else min(tokens, before))
            done = run.step(tokens, images)
            response = run.response() if done else None
            if done:
                self.run = None
            # a guard trip restarts the run on the exact path: tokens_left grows back, count nothing
            return Step(done, response, max(0, before - run.tokens_left), run.tokens_left, None,
                        time.perf_counter() - started, run.images_left)
        except Exception as error:  # noqa: BLE001 - this request alone fails
            self.run = None
            return Step(True, None, 0, 0, _as_device_error(error), time.perf_counter() - started)

    def drop(self) -> None:
        self.run = None

    def _infer(self, prepared: list[Prepared]) -> list[dict]:
        self._hooks(prepared, sum(p.num_tokens for p in prepared))
        return self.engine.infer(prepared)

    def _hooks(self, prepared: list[Prepared], tokens: int) -> None:
        """Test hooks (server/testhooks.py); no-ops in production."""
        hooks = self.hooks
        if hooks.batch_delay_s or hooks.token_delay_s:
            time.sleep(hooks.batch_delay_s + hooks.token_delay_s * tokens)
        states = [p.request.get("state") for p in prepared]
        states = [state for state in states if isinstance(state, str)]
        if hooks.sticky_marker is not None and any(hooks.sticky_marker in state for state in states):
            self.broken = True
        self._broken()
        if hooks.fail_marker is not None and any(hooks.fail_marker in state for state in states):
            raise DeviceError("injected device fault (test hook)")

    def _broken(self) -> None:
        if self.broken:
            raise DeviceError("injected sticky device fault (test hook): every call fails")


_OPS: dict[str, Callable] = {"load": _Device.load, "self_check": _Device.self_check, "measure": _Device.measure,
                             "measure_tower": _Device.measure_tower, "infer": _Device.infer, "step": _Device.step,
                             "drop": _Device.drop}


def _serve(conn, hooks: TestHooks) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # the server drains on these, then closes the pipe
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    device = _Device(hooks)
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):    # the server is gone
            return
        if op == "stop":
            return
        try:
            reply = (True, _OPS[op](device, *args))
        except BaseException as error:  # noqa: BLE001 - handed to the awaiting coroutine
            reply = (False, _portable(error))
        status = device.engine.status() if device.engine is not None else None
        try:
            conn.send((*reply, status))
        except (BrokenPipeError, OSError):
            return


def _portable(error: BaseException) -> BaseException:
    """``error`` if it survives the pipe, else a DeviceError that names it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any pickling failure
        return DeviceError(f"{type(error).__name__}: {error}")


def _as_device_error(error: Exception) -> DeviceError:
    return error if isinstance(error, DeviceError) else DeviceError(f"{type(error).__name__}: {error}")
