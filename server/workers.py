"""One worker process per GPU.

Each worker is a complete single-device server bound to the same port with SO_REUSEPORT, so the kernel
spreads connections over them and no request ever crosses a process boundary. The supervisor only
forwards SIGTERM and waits. When one worker dies on its own, the supervisor stops the others and exits
non-zero: a pod with a missing GPU worker should be restarted whole, not keep serving at reduced capacity
while /health (answered by the survivors) says all is well.

Each worker keeps its own /metrics; Prometheus sees whichever worker answers the scrape (documented in
docs/operations.md).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import sys
from multiprocessing.connection import wait

from .logs import log


def supervise(args: argparse.Namespace, devices: list[str]) -> int:
    if args.port == 0:
        raise SystemExit("several workers share one port: give --port explicitly")
    spawn = multiprocessing.get_context("spawn")  # no CUDA state may be inherited through fork
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    workers = []
    try:
        for device in devices:
            # Only plain option values cross into the spawned process (the CLI adds a non-picklable `func`).
            child = argparse.Namespace(**{k: v for k, v in vars(args).items() if not callable(v)})
            child.workers, child.reuse_port = 0, True
            child.device = _isolate(device, inherited)
            process = spawn.Process(target=_worker, args=(child,), name=f"clef-worker-{device}")
            process.start()  # the child copies os.environ now
            workers.append(process)
    finally:
        _restore("CUDA_VISIBLE_DEVICES", inherited)
    log("supervisor", pid=os.getpid(), workers=[(p.name, p.pid) for p in workers])

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
            if process.exitcode != 0:
                code = code or (process.exitcode if process.exitcode > 0 else 1)
            if not stopping:
                log("worker_exited", level="error", worker=process.name, exitcode=process.exitcode)
                stop_all()
    return code


def _isolate(device: str, inherited: str | None) -> str:
    """Make GPU N the only one the next worker sees, so that every CUDA call in it, on any thread, lands
    on its own GPU (CuPy's current device defaults to 0 in each new thread)."""
    if not device.startswith("cuda"):
        return device
    index = int(device.partition(":")[2] or 0)
    visible = inherited.split(",") if inherited else [str(i) for i in range(index + 1)]
    if index >= len(visible):
        raise SystemExit(f"{device}: CUDA_VISIBLE_DEVICES={inherited} shows only {len(visible)} GPU(s)")
    os.environ["CUDA_VISIBLE_DEVICES"] = visible[index]
    return "cuda:0"


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _worker(args: argparse.Namespace) -> None:
    from .app import run

    sys.exit(run(args))
