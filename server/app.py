"""`clefcore serve`: System One over HTTP (aiohttp + uvloop).

One request through this module: middleware (request id, auth, error shape, log line, metrics)
► handler (phase, content type, body size, JSON) ► engine.prepare on a CPU thread, smallest bodies first
(server/prepare.py; validation and tokenization happen before queueing, so a bad body never takes a queue
slot) ► batcher (queue, packed forward in the device process: server/device_process.py) ► bare or Cloudflare-enveloped JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import os
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import web

from clefcore.answers import CONFIDENCE_MODES
from clefcore.checkpoint import Checkpoint
from clefcore.errors import ClefError, RequestError
from clefcore.options import backend_options, gpu_options, image_options
from clefcore.preparer import Preparer

from . import admission, errors
from .admission import Budgets
from .batcher import Batcher, DeadlineExceeded, QueueFull
from .body import read_json
from .codings import DECODED
from .device_process import DeviceProcess
from .engine_status import describe
from .lifecycle import DRAINING, FAILED, LOADING, READY, Lifecycle
from .logs import RefusalLog, log
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import Metrics, clear_multiprocess_dir, multiprocess_dir
from .openapi import build_spec
from .prepare import PrepareGate
from .testhooks import TestHooks
from .workers import supervise

PLAYGROUND = Path(__file__).parent / "playground" / "index.html"
CLOUDFLARE_PREFIX = "/client/v4/"
CLOUDFLARE_MODELS = ("clef", "clef-flash")
CLOUDFLARE_NAMESPACE = "@cf/cloudflare/"
# A client-supplied x-request-id is echoed only when it is short and harmless in a log line or header.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")

STATE = web.AppKey("state", "ServerState")


class ServerState:
    """Everything the handlers share. ``preparer`` and ``batcher`` are None until the model is loaded; the
    engine itself lives in the device process, and ``device.status`` says what it runs as."""

    def __init__(self, config: argparse.Namespace):
        self.config = config
        self.lifecycle = Lifecycle()
        self.metrics = Metrics()
        self.refusals = RefusalLog()
        self.hooks = TestHooks.from_environment()
        self.device = DeviceProcess(self.hooks, config.chunk_tokens)
        self.preparer: Preparer | None = None
        self.batcher: Batcher | None = None
        # Validation + tokenization of incoming bodies; a pool so one long state does not hold up the rest, and a
        # gate in front of it that hands it the smallest bodies first (server/prepare.py).
        threads = max(2, min(4, os.cpu_count() or 2))
        self.cpu = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="clef-prepare")
        self.prepare = PrepareGate(threads, on_wait=self.metrics.prepare_wait.observe)


# --- command line -------------------------------------------------------------------------------------

def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def _non_negative(kind):
    def parse(text: str):
        value = kind(text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def _age_rate(text: str) -> float | None:
    if text.strip().lower() == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of tokens/s, inf or auto, got {text}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 tokens/s, inf or auto, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="model directory (config.json, safetensors, tokenizer)")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda:N, or a comma-separated list of devices, one worker process each "
                             "(default: %(default)s)")
    parser.add_argument("--workers", type=int, default=0,
                        help="with --device cuda: serve on cuda:0..N-1, one worker process per GPU "
                             "(default: %(default)s, off)")
    image_options(parser)
    gpu_options(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="listen address; 0.0.0.0 in a container (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8080,
                        help="listen port; 0 picks a free one and logs it (default: %(default)s)")
    parser.add_argument("--validation", default="cloudflare", choices=("cloudflare", "reference"),
                        help="request rules: Cloudflare's limits, or the reference code's lenient ones "
                             "(default: %(default)s)")
    parser.add_argument("--confidence", default="cloudflare", choices=CONFIDENCE_MODES,
                        help="confidence formula: cloudflare (Gini form, as hosted Clef) or another client's "
                             "(default: %(default)s)")
    parser.add_argument("--context-length", type=_positive(int), default=24576,
                        help="maximum prompt tokens (default: %(default)s)")
    parser.add_argument("--on-overflow", default="truncate", choices=("truncate", "reject"),
                        help="over-long state: cut its tail like the reference, or answer 400 "
                             "(default: %(default)s)")
    parser.add_argument("--max-body-bytes", type=_positive(int), default=13 * 1024 * 1024,
                        help="largest request body accepted in bytes, 413 above (default: %(default)s)")
    parser.add_argument("--max-batch-tokens", type=_positive(int), default=16384,
                        help="token budget of one packed forward (default: %(default)s)")
    parser.add_argument("--max-batch-requests", type=_positive(int), default=32,
                        help="requests in one packed forward (default: %(default)s)")
    parser.add_argument("--max-queue", type=_positive(int), default=256,
                        help="queued requests before answering 429 (default: %(default)s)")
    parser.add_argument("--request-timeout", type=_positive(float), default=30.0,
                        help="seconds a request may wait for its answer, 503 after (default: %(default)s)")
    parser.add_argument("--max-queue-wait", type=_positive(float), default=None,
                        help="the wait a request of --context-length tokens tolerates, shorter ones in "
                             "proportion: a request is admitted while the work that runs before it plus its "
                             "own (tokens / measured device rate) fits, else 429 (default: half of "
                             "--request-timeout)")
    parser.add_argument("--min-queue-wait", type=_positive(float), default=1.0,
                        help="the wait any request tolerates, however short it is; never less than one "
                             "device step, one chunk and its own run (default: %(default)s)")
    parser.add_argument("--chunk-tokens", type=_non_negative(int), default=4096,
                        help="run prompts longer than this in chunks of this many tokens, between batches of "
                             "short ones; 0: off (default: %(default)s)")
    parser.add_argument("--age-rate", type=_age_rate, default=None,
                        help="scheduler aging, prompt tokens of priority per second waited: a number, inf "
                             "(first in, first out) or auto (default: auto, the measured device rate)")
    parser.add_argument("--shutdown-timeout", type=_positive(float), default=30.0,
                        help="seconds to finish accepted requests after SIGTERM (default: %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("CLEFCORE_API_KEY"),
                        help="require this key on /v1 and /client/v4 routes (default: $CLEFCORE_API_KEY; "
                             "unset: no key is required)")


def run(args: argparse.Namespace) -> int:
    devices = _devices(args)
    if len(devices) > 1:
        return supervise(args, devices, run)
    args.device = devices[0]
    if multiprocess_dir() and not getattr(args, "reuse_port", False):
        clear_multiprocess_dir()  # a lone server in a directory named for it: an earlier run's files go
    import uvloop
    return uvloop.run(_serve(args))


def _devices(args: argparse.Namespace) -> list[str]:
    devices = [d.strip() for d in args.device.split(",") if d.strip()]
    if args.workers > 0:
        if devices != ["cuda"]:
            raise SystemExit("--workers N goes with --device cuda (it serves on cuda:0..N-1)")
        return [f"cuda:{i}" for i in range(args.workers)]
    return devices or ["cpu"]


# --- server -------------------------------------------------------------------------------------------

async def _serve(args: argparse.Namespace) -> int:
    state = ServerState(args)
    app = build_app(state)
    # handler_cancellation: a client that disconnects cancels its handler, which drops its queue entry.
    # shutdown_timeout is aiohttp's wait for handlers at cleanup; by then our own drain has answered every
    # request, so it only covers writing those last responses.
    # auto_decompress=False: server/body.py decodes request bodies itself (server/codings.py says why).
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0,
                           auto_decompress=False)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, reuse_port=getattr(args, "reuse_port", False))
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - the real port when --port 0
    log("listening", host=args.host, port=port, pid=os.getpid(), device=args.device,
        content_encodings=list(DECODED))
    lifecycle = state.lifecycle
    lifecycle.install_signal_handlers()

    loader = asyncio.ensure_future(_load(state))
    stop = asyncio.ensure_future(lifecycle.stop_requested.wait())
    await asyncio.wait({loader, stop}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if not loader.done():  # SIGTERM while loading: nothing was accepted, leave at once
        lifecycle.set(DRAINING, "shutting down")
        loader.cancel()
    elif loader.exception() is not None or lifecycle.phase == FAILED:
        code = 1
    else:
        await stop
        if lifecycle.phase == FAILED:   # the device process is gone: nothing queued can be answered
            code = 1
        else:
            lifecycle.set(DRAINING, "shutting down")
            log("draining", queued=state.batcher.queued, in_flight=lifecycle.in_flight)
            drained = await lifecycle.wait_drained(state.batcher.idle, args.shutdown_timeout)
            log("drained" if drained else "drain_timeout", in_flight=lifecycle.in_flight)
        await state.batcher.stop()
    state.metrics.ready.set(0)
    await runner.cleanup()
    state.refusals.flush()
    await state.device.stop()
    state.cpu.shutdown(wait=False, cancel_futures=True)
    log("exit", code=code)
    return code


async def _load(state: ServerState) -> None:
    cfg = state.config
    started = time.monotonic()
    if state.hooks.load_delay_s:
        await asyncio.sleep(state.hooks.load_delay_s)
    try:
        engine = await state.device.load(dict(
            path=cfg.model, device=cfg.device, max_length=cfg.context_length, confidence=cfg.confidence,
            validation=cfg.validation, images=not cfg.no_images, **backend_options(cfg)))
        state.lifecycle.set(LOADING, "warming up and running the self-check")
        await state.device.self_check()
        # the host side of requests (validation, images, tokenizer) lives here, beside the event loop
        preparer = await asyncio.get_running_loop().run_in_executor(state.cpu, lambda: Preparer(
            Checkpoint(cfg.model), cfg.context_length, cfg.validation, engine.images_refused))
    except Exception as error:  # noqa: BLE001 - any load failure ends the process with a clear line
        state.lifecycle.set(FAILED, f"{type(error).__name__}: {error}")
        log("load_failed", level="error", error=str(error), error_type=type(error).__name__)
        return
    state.device.on_lost = lambda reason: _device_lost(state, reason)
    state.preparer = preparer
    state.metrics.watch_engine(state.device.status)
    state.batcher = Batcher(state.device, state.metrics, max_queue=cfg.max_queue,
                            max_batch_tokens=cfg.max_batch_tokens, max_batch_requests=cfg.max_batch_requests,
                            budgets=Budgets(cfg.min_queue_wait, wait_budget(cfg), cfg.context_length),
                            start_rate=admission.start_rate(cfg.device), chunk_tokens=cfg.chunk_tokens,
                            age_rate=cfg.age_rate)
    state.batcher.start()
    state.lifecycle.set(READY, "ready")
    state.metrics.ready.set(1)
    log("ready", model=engine.model_name, device=engine.device, load_s=round(time.monotonic() - started, 3),
        images=engine.images_refused or "answered")


def _device_lost(state: ServerState, reason: str) -> None:
    """The device process died: nothing more can be answered, so the server exits non-zero (and is restarted)."""
    state.lifecycle.set(FAILED, reason)
    state.metrics.ready.set(0)
    log("device_lost", level="error", error=reason)
    state.lifecycle.stop_requested.set()


def wait_budget(cfg: argparse.Namespace) -> float:
    """Seconds of expected wait a request of --context-length tokens may be admitted into: half the timeout
    leaves the other half for the estimate's error."""
    budget = getattr(cfg, "max_queue_wait", None)
    return budget if budget is not None else cfg.request_timeout / 2


def _refused(refusal, capacity: int, request: web.Request) -> errors.ApiError:
    request["log"]["refused"] = refusal.reason  # for the refusals' aggregated log line
    if refusal.reason == "queue_full":
        return errors.queue_full(capacity, refusal.retry_after_s)
    return errors.overloaded(refusal.wait_s, refusal.budget_s, refusal.retry_after_s)


def build_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[_middleware])
    app[STATE] = state
    app.router.add_post("/v1/systemone", _systemone)
    # The model is everything after run/: Cloudflare's SDKs percent-encode it as one path segment
    # (`@cf%2Fcloudflare%2Fclef-flash`), curl and fetch send it as three; aiohttp matches on the path with
    # %2F kept encoded and decodes the captured value, so both arrive here as `@cf/cloudflare/clef-flash`.
    app.router.add_post("/client/v4/accounts/{account}/ai/run/{model:.+}", _cloudflare)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/live", _live)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/openapi.json", _openapi)
    app.router.add_get("/", _playground)
    return app


# --- middleware: ids, auth, errors, the log line, request metrics --------------------------------------

def _protected(path: str) -> bool:
    return path.startswith("/v1/") or path.startswith(CLOUDFLARE_PREFIX)


def _authorised(request: web.Request, key: str) -> bool:
    auth = request.headers.get("Authorization", "")
    # Bearer (TypeSafe, OpenAI-style and Cloudflare token clients), X-Api-Key, or Cloudflare's legacy
    # X-Auth-Key (sent with X-Auth-Email by its SDKs when given an api_key instead of a token).
    offered = auth[7:].strip() if auth[:7].lower() == "bearer " else (
        request.headers.get("X-Api-Key") or request.headers.get("X-Auth-Key") or "")
    return hmac.compare_digest(offered.encode(), key.encode())


@web.middleware
async def _middleware(request: web.Request, handler) -> web.StreamResponse:
    state: ServerState = request.app[STATE]
    request["started"] = time.monotonic()
    offered_id = request.headers.get("x-request-id", "")
    request["id"] = offered_id if _REQUEST_ID.fullmatch(offered_id) else uuid.uuid4().hex
    request["log"] = {}
    cloudflare = request.path.startswith(CLOUDFLARE_PREFIX)
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"  # bounded label set
    try:
        response = await _answer(request, handler, state)
    except errors.ApiError as error:
        response = _error_response(error, request["id"], cloudflare)
        request["log"]["error"] = error.kind
        if error.status >= 500:
            state.metrics.failures.labels(error.kind).inc()
    except asyncio.CancelledError:
        _finish(state, request, route, 499)  # nginx's "client closed request": logged, never sent
        raise
    response.headers["x-request-id"] = request["id"]
    if cloudflare:
        response.headers["cf-ai-req-id"] = request["id"]
    _finish(state, request, route, response.status)
    return response


async def _answer(request: web.Request, handler, state: ServerState) -> web.StreamResponse:
    """Run the handler; every failure comes out as an ApiError (the server answers, it never crashes)."""
    try:
        key = state.config.api_key
        if key and _protected(request.path) and not _authorised(request, key):
            raise errors.unauthorized()
        return await handler(request)
    except web.HTTPException as http_error:  # aiohttp's own 404/405
        raise _from_http_exception(request, http_error) from None
    except errors.ApiError:
        raise
    except Exception as error:  # noqa: BLE001
        log("unhandled", level="error", request_id=request["id"], error=repr(error))
        raise errors.internal(error) from None


def _finish(state: ServerState, request: web.Request, route: str, status: int) -> None:
    duration = time.monotonic() - request["started"]
    state.metrics.requests.labels(route, str(status)).inc()
    refused = request["log"].get("refused")
    if refused is not None:  # one line a second for all of them: a retry storm must not cost a line each
        state.refusals.note(refused)
        return
    log("request", request_id=request["id"], method=request.method, path=request.path, route=route,
        status=status, duration_ms=round(duration * 1000, 2), client=request.remote, **request["log"])


def _from_http_exception(request: web.Request, http_error: web.HTTPException) -> errors.ApiError:
    if http_error.status == 404:
        return errors.not_found(request.path)
    if http_error.status == 405:
        return errors.method_not_allowed(request.method, http_error.headers.get("Allow", ""))
    return errors.ApiError(http_error.status, http_error.reason, "http_error", cf_code=errors.CF_BAD_INPUT)


def _json(body: Any, status: int = 200, headers: dict | None = None) -> web.Response:
    # allow_nan=False: a NaN must never reach a client as invalid JSON; it surfaces as a 500 instead.
    text = json.dumps(body, ensure_ascii=False, allow_nan=False)
    return web.Response(text=text, status=status, content_type="application/json", headers=headers)


def _error_response(error: errors.ApiError, request_id: str, cloudflare: bool) -> web.Response:
    if cloudflare:
        return _json(error.cloudflare_body(request_id), error.cf_status, error.headers)
    return _json(error.bare_body(), error.status, error.headers)


# --- decision routes ----------------------------------------------------------------------------------

async def _systemone(request: web.Request) -> web.Response:
    response = await _decide(request, path_model=None)
    return _json(response)


def cloudflare_model(name: str) -> str | None:
    """`clef-flash` for `@cf/cloudflare/clef-flash` (the path's form) or a bare `clef-flash` (the body's form,
    whitespace allowed as in Workers AI's schema); None for any other model."""
    name = name.strip()
    if name.startswith(CLOUDFLARE_NAMESPACE):
        name = name[len(CLOUDFLARE_NAMESPACE):]
    return name if name in CLOUDFLARE_MODELS else None


async def _cloudflare(request: web.Request) -> web.Response:
    path_model = request.match_info["model"]
    model = cloudflare_model(path_model) if path_model.startswith(CLOUDFLARE_NAMESPACE) else None
    if model is None:
        raise errors.no_cloudflare_model(path_model)
    result = await _decide(request, path_model=model)
    # Workers AI reports the selector from the path (`clef` / `clef-flash`), not the served checkpoint.
    result["model"] = model
    return _json({"result": result, "success": True, "errors": [], "messages": []},
                 headers={"cache-control": "no-store"})


async def _decide(request: web.Request, path_model: str | None) -> dict:
    state: ServerState = request.app[STATE]
    cfg = state.config
    lifecycle = state.lifecycle
    if lifecycle.phase != READY:
        raise errors.unavailable(lifecycle.reason, retry_after_s=5 if lifecycle.phase == LOADING else 1)
    lifecycle.in_flight += 1
    try:
        batcher = state.batcher
        # Refuse before reading and tokenizing when the queue is already full or the work before a body of
        # this size is over its budget: shedding load must be cheap. A compressed body's size says little.
        plain = request.headers.get("Content-Encoding", "identity").strip().lower() in ("", "identity")
        body_bytes = request.content_length if plain else None
        refusal = batcher.early_refusal(body_bytes)
        if refusal is not None:
            raise _refused(refusal, batcher.capacity, request)
        body = await read_json(request, cfg.max_body_bytes, state.cpu)
        if path_model is not None and isinstance(body, dict):
            # Workers AI takes the model from the path: a body may leave it out or name it either way.
            body_model = body.setdefault("model", path_model)
            if isinstance(body_model, str) and cloudflare_model(body_model) != path_model:
                raise errors.model_mismatch(body_model, path_model)
        try:
            prepared = await state.prepare.run(request["log"].get("bytes_in", 0),
                                               lambda: state.preparer.prepare(body, on_overflow=cfg.on_overflow),
                                               state.cpu)
        except RequestError as error:
            raise errors.invalid_request(error) from None
        request["log"]["prompt_tokens"] = prepared.num_tokens
        batcher.sizer.observe(body_bytes, prepared.num_tokens)
        deadline = time.monotonic() + cfg.request_timeout
        try:
            outcome = await batcher.submit(prepared, deadline)
        except QueueFull as full:
            raise _refused(full.refusal, batcher.capacity, request) from None
        except DeadlineExceeded:
            raise errors.timed_out(cfg.request_timeout) from None
        except ClefError as error:
            raise errors.inference_failed(error) from None
        metrics = state.metrics
        metrics.prompt_tokens.inc(prepared.num_tokens)
        metrics.prompt_tokens_hist.observe(prepared.num_tokens)
        metrics.e2e.labels("cloudflare" if path_model else "systemone").observe(
            time.monotonic() - request["started"])
        request["log"].update(queue_ms=round(outcome.queue_wait_s * 1000, 2),
                              prefill_ms=round(outcome.prefill_s * 1000, 2),
                              batch_requests=outcome.batch_requests, batch_tokens=outcome.batch_tokens)
        response = outcome.response
        # The engine echoes the request's `model`; strict clients (instructor-php) refuse an empty one.
        if not str(response.get("model", "")).strip():
            response["model"] = state.device.status.model_name
        return response
    finally:
        lifecycle.in_flight -= 1


# --- plain routes -------------------------------------------------------------------------------------

async def _models(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    engine = state.device.status
    if state.preparer is None:
        raise errors.unavailable(state.lifecycle.reason, retry_after_s=5)
    cfg = state.config
    # TypeSafe's shape (systemone-protocol.md §14.8); the extra keys inside the entry are ignored by it.
    return _json({"models": [{
        "name": engine.model_name,
        "description": "Cloudflare Clef-flash joint-schema decision model (System One), served by clefcore",
        "release_date": "2026-10-01",
        "device": engine.device,
        "max_context_length": cfg.context_length,
        "validation": cfg.validation,
        "confidence": cfg.confidence,
    }]})


async def _health(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    lifecycle = state.lifecycle
    body = {"status": "ok" if lifecycle.phase == READY else lifecycle.phase, "reason": lifecycle.reason,
            "uptime_s": round(time.time() - lifecycle.started_at, 1)}
    if state.preparer is not None:
        engine = state.device.status
        body.update(model=engine.model_name, device=engine.device)
        body.update(describe(engine))
    if lifecycle.phase != READY:
        return _json(body, 503, {"Retry-After": "5" if lifecycle.phase == LOADING else "1"})
    return _json(body)


async def _live(request: web.Request) -> web.Response:
    # Liveness says only "the event loop answers": a full queue or a draining server is still alive, and
    # restarting it would lose the queued requests (TGI #3241).
    return _json({"status": "alive"})


async def _metrics(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    body = state.metrics.render()
    return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})


async def _openapi(request: web.Request) -> web.Response:
    return _json(build_spec(request.app[STATE].config))


async def _playground(request: web.Request) -> web.Response:
    return web.Response(body=PLAYGROUND.read_bytes(), content_type="text/html", charset="utf-8")
