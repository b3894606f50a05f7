"""`clefcore serve`: the process. A Service (server/service.py) behind clefcore's routes (server/routes.py) on
uvloop, listening at once and loading meanwhile (/health answers 503 until ready), draining on SIGTERM. Several
devices (``--device a,b``, ``--workers N``): with ``--spread queue`` (the default) that one process drives a
device process per device from one queue; with ``--spread workers`` one such process per device, started by
server/workers.py on one port with SO_REUSEPORT. The flags are clefcore/options.py's ``serve_options``.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import os

from aiohttp import web

from clefcore.errors import ClefError
from clefcore.options import ServiceConfig, device_list

from .codings import DECODED
from .head_deadline import listen, track
from .lifecycle import FAILED
from .logs import log
from .metrics import clear_multiprocess_dir, multiprocess_dir
from .routes import build_app
from .service import Service
from .workers import supervise


def run(args: argparse.Namespace) -> int:
    devices = _devices(args)
    if len(devices) > 1 and args.spread == "workers":
        return supervise(args, devices, run)
    args.device = ",".join(devices)
    if multiprocess_dir() and not args.reuse_port:
        clear_multiprocess_dir()  # a lone server in a directory named for it: an earlier run's files go
    import uvloop
    return uvloop.run(_serve(args))


def _devices(args: argparse.Namespace) -> list[str]:
    devices = list(device_list(args.device))
    if args.workers > 0:
        if devices != ["cuda"]:
            raise SystemExit("--workers N goes with --device cuda (it serves on cuda:0..N-1)")
        return [f"cuda:{i}" for i in range(args.workers)]
    return devices or ["cpu"]


async def _serve(args: argparse.Namespace) -> int:
    service = Service(ServiceConfig.from_args(args))
    app = build_app(service, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                    body_timeout=args.body_timeout)
    app.middlewares.insert(0, track)   # tells each connection's head deadline when its request arrived
    # handler_cancellation: a client that disconnects cancels its handler, which drops its queue entry.
    # shutdown_timeout is aiohttp's wait for handlers at cleanup; by then our own drain has answered every
    # request, so it only covers writing those last responses.
    # auto_decompress=False: server/body.py decodes request bodies itself (server/codings.py says why).
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0,
                           auto_decompress=False)
    await runner.setup()
    try:
        server = await listen(runner, args.host, args.port, reuse_port=args.reuse_port,
                              head_timeout_s=args.header_timeout, write_timeout_s=args.write_timeout)
    except OSError as error:
        await runner.cleanup()
        if error.errno == errno.EADDRINUSE:
            raise ClefError(f"port {args.port} on {args.host} is already in use: stop what listens there, or "
                            "choose another with --port") from error
        raise ClefError(f"cannot listen on {args.host}:{args.port}: {error.strerror or error}") from error
    port = server.sockets[0].getsockname()[1]  # the real port when --port 0
    log("listening", host=args.host, port=port, pid=os.getpid(), device=args.device,
        content_encodings=list(DECODED))
    lifecycle = service.lifecycle
    lifecycle.install_signal_handlers()

    loader = asyncio.ensure_future(service.start())
    stop = asyncio.ensure_future(lifecycle.stop_requested.wait())
    await asyncio.wait({loader, stop}, return_when=asyncio.FIRST_COMPLETED)
    code, failed = 0, None
    if not loader.done():  # SIGTERM while loading: nothing was accepted, leave at once
        loader.cancel()
        await service.drain(args.shutdown_timeout)
    elif loader.exception() is not None:   # logged by start(); the process exits non-zero and is restarted
        code, failed = 1, loader.exception()
    else:
        await stop
        # after a lost device process nothing queued can be answered: drain only answers it with timeouts
        await service.drain(args.shutdown_timeout)
        code = 1 if lifecycle.phase == FAILED else 0
    server.close()
    await runner.cleanup()
    await service.stop()
    log("exit", code=code)
    if isinstance(failed, ClefError):      # a model that cannot load: the user's line on stderr too (cli.main)
        raise failed
    return code
