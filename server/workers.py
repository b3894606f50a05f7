"""One worker process per GPU.

Each worker is a complete single-device server bound to the same port with SO_REUSEPORT, so the kernel
spreads connections over them and no request ever crosses a process boundary. The supervisor only
forwards SIGTERM and waits. When one worker dies on its own, the supervisor stops the others and exits
non-zero: a pod with a missing GPU worker should be restarted whole, not keep serving at reduced capacity
while /health (answered by the survivors) says all is well.

/metrics answers for the whole pod whichever worker takes the scrape: the workers write their values to
files in one directory (prometheus_client's multiprocess mode, server/metrics.py) that the supervisor
prepares before they start and tidies after each one exits.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path

from prometheus_client.multiprocess import mark_process_dead

from clefcore.errors import ClefError

from . import gpus
from .logs import log
from .metrics import MULTIPROC_ENV, clear_multiprocess_dir


def supervise(args: argparse.Namespace, devices: list[str], serve: Callable[[argparse.Namespace], int]) -> int:
    """Run ``serve(args)`` in one spawned process per device. ``serve`` is passed in (main.run), not imported:
    the single-device server starts its workers from here, so this module stays below it (no import cycle).
    It must be a module-level function: spawn pickles it by name."""
    if args.port == 0:
        raise SystemExit("several workers share one port: give --port explicitly")
    spawn = multiprocessing.get_context("spawn")  # no CUDA state may be inherited through fork
    metrics_dir, owned = _metrics_dir()
    try:
        return _run_workers(args, devices, serve, spawn, metrics_dir)
    finally:
        if owned:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def _metrics_dir() -> tuple[str, bool]:
    """The directory the workers share their metrics through, and whether we made it (and so remove it).

    A directory named by PROMETHEUS_MULTIPROC_DIR (an emptyDir in Kubernetes, so it outlives a container
    restart) is emptied first: files left by a previous run's workers would be counted again."""
    given = os.environ.get(MULTIPROC_ENV)
    if given:
        Path(given).mkdir(parents=True, exist_ok=True)
        clear_multiprocess_dir()
        return given, False
    path = tempfile.mkdtemp(prefix="clefcore-metrics-")
    os.environ[MULTIPROC_ENV] = path  # inherited by every worker started below
    return path, True


def _run_workers(args, devices, serve, spawn, metrics_dir) -> int:
    workers = []
    for lane, device in enumerate(devices):
        # Only plain option values cross into the spawned process (the CLI adds a non-picklable `func`).
        child = argparse.Namespace(**{k: v for k, v in vars(args).items() if not callable(v)})
        child.workers, child.reuse_port, child.first_lane = 0, True, lane
        try:
            with gpus.alone(device) as child.device:
                process = spawn.Process(target=_worker, args=(serve, child), name=f"clef-worker-{device}")
                process.start()  # the child copies os.environ now
        except ValueError as error:
            raise SystemExit(str(error)) from None
        workers.append(process)
    log("supervisor", pid=os.getpid(), workers=[(p.name, p.pid) for p in workers], metrics_dir=metrics_dir)

    stopping = False

    def stop_all(signum: int = signal.SIGTERM, frame: object = None) -> None:
        nonlocal stopping
        stopping = True
        for process in workers:
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop_all)
    signal.signal(signal.SIGINT, stop_all)
    code = 0
    remaining = list(workers)
    while remaining:
        for sentinel in wait([p.sentinel for p in remaining]):
            process = next(p for p in remaining if p.sentinel == sentinel)
            process.join()
            remaining.remove(process)
            # Its live gauges (queue depth, readiness, memory) must stop counting; its counters stay.
            mark_process_dead(process.pid, metrics_dir)
            if process.exitcode != 0:
                code = code or (process.exitcode if process.exitcode > 0 else 1)
            if not stopping:
                log("worker_exited", level="error", worker=process.name, exitcode=process.exitcode)
                stop_all()
    return code


def _worker(serve: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> None:
    try:
        code = serve(args)
    except ClefError as error:   # a model that cannot load, a busy port: one line, as `clefcore serve` says it
        sys.stderr.write(f"clefcore serve: {error.message}\n")
        code = 1
    sys.exit(code)
