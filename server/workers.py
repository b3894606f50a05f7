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
    workers = []
    for device in devices:
        # Only plain option values cross into the spawned process (the CLI adds a non-picklable `func`).
        child = argparse.Namespace(**{k: v for k, v in vars(args).items() if not callable(v)})
        child.device, child.workers, child.reuse_port = device, 0, True
        process = spawn.Process(target=_worker, args=(child,), name=f"clef-worker-{device}")
        process.start()
        workers.append(process)
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


def _worker(args: argparse.Namespace) -> None:
    from .app import run

    sys.exit(run(args))
