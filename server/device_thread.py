"""One daemon thread for every call that touches the device: model load, self-check, packed forwards.

CuPy keeps the current device, streams and memory pools per thread, so running the load on one thread and
the forwards on another is a way to end up on the wrong GPU or with a second pool. One thread for all of
it keeps the engine on exactly the state it was loaded with. The thread is a daemon so that a SIGTERM
during a minutes-long load ends the process without waiting for the load to finish.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any, Callable


class DeviceThread:
    def __init__(self, name: str = "clef-device"):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def run(self, fn: Callable, *args: Any) -> asyncio.Future:
        """Queue ``fn(*args)`` on the device thread; the returned future settles on the caller's loop."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._calls.put((loop, future, fn, args))
        return future

    def stop(self) -> None:
        """Let the thread end after the call it is running (it is never interrupted mid-forward)."""
        self._calls.put(None)

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            loop, future, fn, args = call
            try:
                outcome = (fn(*args), None)
            except BaseException as error:  # noqa: BLE001 - handed to the awaiting coroutine
                outcome = (None, error)
            try:
                loop.call_soon_threadsafe(_settle, future, *outcome)
            except RuntimeError:  # the loop is closed: the server is exiting and nobody waits any more
                return


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
