"""clefcore's HTTP routes over a Service: one route table, the middleware, the handlers.

One request: middleware (request id, auth, error shape, log line, metrics) ► handler (phase, body size, content
type, JSON) ► ``Service.answer`` (server/service.py: prepare on threads, batcher, packed forward in the device
process) ► bare or Cloudflare-enveloped JSON. The Service's typed errors become status codes here
(``_api_error``).

``build_app`` makes the application `clefcore serve` runs (server/main.py). ``mount`` adds the same routes to an
application of the caller's under a path prefix, as a sub-application: the middleware then covers clefcore's
routes (and unknown paths under the prefix) only. ``ROUTES`` is the table both mount, and /openapi.json's paths
are generated from it (server/openapi.py).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from clefcore.errors import RequestError
from clefcore.example_request import support_ticket
from clefcore.options import BODY_TIMEOUT, MAX_BODY_BYTES

from . import errors
from .body import decode, parse, receive
from .engine_status import describe
from .logs import RefusalLog, log
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .openapi import build_spec
from .service import InferenceFailed, Overloaded, Service, TimedOut, Unavailable

PLAYGROUND = Path(__file__).parent / "playground" / "index.html"
CLOUDFLARE_PREFIX = "/client/v4/"
CLOUDFLARE_MODELS = ("clef", "clef-flash")
CLOUDFLARE_NAMESPACE = "@cf/cloudflare/"
# A client-supplied x-request-id is echoed only when it is short and harmless in a log line or header.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Http:
    """What the routes add to the Service: the API key (None: none required), the body's size limit and the
    seconds it may take to arrive, the log line of 429s, and the prefix the routes are mounted under ("" at the
    root)."""
    api_key: str | None
    max_body_bytes: int
    body_timeout: float
    prefix: str
    refusals: RefusalLog


SERVICE = web.AppKey("service", Service)
HTTP = web.AppKey("http", Http)


# --- middleware: ids, auth, errors, the log line, request metrics --------------------------------------

def _protected(path: str) -> bool:
    return path.startswith("/v1/") or path.startswith(CLOUDFLARE_PREFIX)


def _local(request: web.Request) -> str:
    """The request's path below the mount prefix (requests reach a sub-application only under its prefix)."""
    return request.path[len(request.app[HTTP].prefix):]


def _authorised(request: web.Request, key: str) -> bool:
    auth = request.headers.get("Authorization", "")
    # Bearer (TypeSafe, OpenAI-style and Cloudflare token clients), X-Api-Key, or Cloudflare's legacy
    # X-Auth-Key (sent with X-Auth-Email by its SDKs when given an api_key instead of a token).
    offered = auth[7:].strip() if auth[:7].lower() == "bearer " else (
        request.headers.get("X-Api-Key") or request.headers.get("X-Auth-Key") or "")
    return hmac.compare_digest(offered.encode(), key.encode())


@web.middleware
async def _middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    service = request.app[SERVICE]
    request["started"] = time.monotonic()
    offered_id = request.headers.get("x-request-id", "")
    request["id"] = offered_id if _REQUEST_ID.fullmatch(offered_id) else uuid.uuid4().hex
    request["log"] = {}
    cloudflare = _local(request).startswith(CLOUDFLARE_PREFIX)
    resource = request.match_info.route.resource
    route = request["route"] = resource.canonical if resource is not None else "unmatched"  # bounded label set
    try:
        response = await _answer(request, handler)
    except errors.ApiError as error:
        response = _error_response(error, request["id"], cloudflare)
        request["log"]["error"] = error.kind
        if error.status >= 500:
            service.metrics.failures.labels(error.kind).inc()
    except asyncio.CancelledError:
        _finish(request, route, 499)  # nginx's "client closed request": logged, never sent
        raise
    response.headers["x-request-id"] = request["id"]
    if cloudflare:
        response.headers["cf-ai-req-id"] = request["id"]
    _finish(request, route, response.status)
    return response


async def _answer(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Run the handler; every failure comes out as an ApiError (the server answers, it never crashes)."""
    try:
        key = request.app[HTTP].api_key
        if key and _protected(_local(request)) and not _authorised(request, key):
            raise errors.unauthorized()
        return await handler(request)
    except web.HTTPException as http_error:  # aiohttp's own 404/405
        raise _from_http_exception(request, http_error) from None
    except errors.ApiError:
        raise
    except (RequestError, Unavailable, Overloaded, TimedOut, InferenceFailed) as error:
        raise _api_error(error, request) from None
    except Exception as error:  # noqa: BLE001
        log("unhandled", level="error", request_id=request["id"], error=repr(error))
        raise errors.internal(error) from None


def _api_error(error: RequestError | Unavailable | Overloaded | TimedOut | InferenceFailed,
               request: web.Request) -> errors.ApiError:
    """The status and body of each way the Service does not answer."""
    if isinstance(error, RequestError):
        return errors.invalid_request(error)
    if isinstance(error, Unavailable):
        return errors.unavailable(error.reason, error.retry_after_s)
    if isinstance(error, Overloaded):
        request["log"]["refused"] = error.refusal.reason.value  # for the refusals' aggregated log line
        return errors.refused(error.refusal, error.capacity)
    if isinstance(error, TimedOut):
        return errors.timed_out(error.timeout_s)
    return errors.inference_failed(error.error)


def _finish(request: web.Request, route: str, status: int) -> None:
    duration = time.monotonic() - request["started"]
    request.app[SERVICE].metrics.requests.labels(route, str(status)).inc()
    refused = request["log"].get("refused")
    if refused is not None:  # one line a second for all of them: a retry storm must not cost a line each
        request.app[HTTP].refusals.note(refused, duration, read="bytes_in" in request["log"])
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
        response = _json(error.cloudflare_body(request_id), error.cf_status, error.headers)
    else:
        response = _json(error.bare_body(), error.status, error.headers)
    if error.close:
        response.force_close()
    return response


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
    service = request.app[SERVICE]
    with service.accept() as arrival:
        # Refuse before reading and tokenizing when the queue is already full or the work before a body of this
        # size is over its budget: shedding load must be cheap. A compressed body's size says little: it is
        # judged once decoded, by its decoded size, as a plain body is by its own.
        plain = request.headers.get("Content-Encoding", "identity").strip().lower() in ("", "identity")
        body_bytes = request.content_length if plain else None
        service.refuse_early(arrival, body_bytes)
        http = request.app[HTTP]
        body = await receive(request, http.max_body_bytes, http.body_timeout)
        data = body.data
        if body.applied:
            data = await decode(body, http.max_body_bytes, service.on_threads)
            body_bytes = len(data)
            service.refuse_early(arrival, body_bytes)
        request["log"]["bytes_in"] = len(data)

        def read() -> Any:   # on the prepare threads
            parsed = parse(data, body.encoding)
            if path_model is not None and isinstance(parsed, dict):
                # Workers AI takes the model from the path: a body may leave it out or name it either way.
                body_model = parsed.setdefault("model", path_model)
                if isinstance(body_model, str) and cloudflare_model(body_model) != path_model:
                    raise errors.model_mismatch(body_model, path_model)
            return parsed
        return await service.answer(read, arrival, route=request["route"],
                                    started=request["started"], body_bytes=body_bytes, read_bytes=len(data),
                                    trace=request["log"])


# --- plain routes -------------------------------------------------------------------------------------

async def _models(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    engine = service.status
    if engine is None:
        raise errors.unavailable(service.lifecycle.reason, retry_after_s=5)
    cfg = service.config
    # TypeSafe's shape (systemone-protocol.md §14.8); the extra keys inside the entry are ignored by it.
    return _json({"models": [{
        "name": engine.model_name,
        "description": "Cloudflare Clef-flash joint-schema decision model (System One), served by clefcore",
        "release_date": "2026-10-01",
        "device": engine.device,
        "max_context_length": cfg.engine.context_length,
        "validation": cfg.engine.validation,
        "confidence": cfg.engine.confidence,
    }]})


async def _health(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    health = service.health()
    body = {"status": health.status, "reason": health.reason,
            "uptime_s": round(time.time() - service.lifecycle.started_at, 1)}
    engine = service.status
    if engine is not None:
        body.update(model=engine.model_name, device=engine.device)
        body.update(describe(engine))
    if not health.ready:
        return _json(body, 503, {"Retry-After": str(health.retry_after_s)})
    return _json(body)


async def _live(request: web.Request) -> web.Response:
    # Alive unless the service has failed (it is exiting): a full queue, a draining server or a device that may
    # still recover is alive, and restarting it would lose the queued requests (TGI #3241).
    health = request.app[SERVICE].health()
    if not health.live:
        return _json({"status": health.status, "reason": health.reason}, 503)
    return _json({"status": "alive"})


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[SERVICE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})


async def _openapi(request: web.Request) -> web.Response:
    http = request.app[HTTP]
    return _json(build_spec(request.app[SERVICE].config, http.api_key, openapi_paths(), http.prefix))


async def _playground(request: web.Request) -> web.Response:
    return web.Response(body=PLAYGROUND.read_bytes(), content_type="text/html", charset="utf-8")


async def _example(request: web.Request) -> web.Response:
    """The body the playground starts from; the page fetches it rather than keep a copy."""
    return _json(support_ticket())


# --- the route table ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Route:
    method: str
    path: str                      # aiohttp's pattern, below the mount prefix
    handler: Handler
    operation: str                 # its operationId in /openapi.json (server/openapi.py describes each)
    spec_path: str | None = None   # the path as /openapi.json writes it, where that differs from ``path``


ROUTES = (
    Route("POST", "/v1/systemone", _systemone, "systemone"),
    # The model is everything after run/: Cloudflare's SDKs percent-encode it as one path segment
    # (`@cf%2Fcloudflare%2Fclef-flash`), curl and fetch send it as three; aiohttp matches on the path with
    # %2F kept encoded and decodes the captured value, so both arrive here as `@cf/cloudflare/clef-flash`.
    Route("POST", "/client/v4/accounts/{account}/ai/run/{model:.+}", _cloudflare, "cloudflareRun",
          spec_path="/client/v4/accounts/{account}/ai/run/@cf/cloudflare/{model}"),
    Route("GET", "/v1/models", _models, "models"),
    Route("GET", "/health", _health, "health"),
    Route("GET", "/live", _live, "live"),
    Route("GET", "/metrics", _metrics, "metrics"),
    Route("GET", "/openapi.json", _openapi, "openapi"),
    Route("GET", "/", _playground, "playground"),
    Route("GET", "/example", _example, "example"),
)


def openapi_paths() -> dict[str, dict[str, str]]:
    """The route table as /openapi.json's paths: path -> method (lower case) -> operationId."""
    paths: dict[str, dict[str, str]] = {}
    for route in ROUTES:
        paths.setdefault(route.spec_path or route.path, {})[route.method.lower()] = route.operation
    return paths


def build_app(service: Service, *, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
              body_timeout: float = BODY_TIMEOUT, prefix: str = "") -> web.Application:
    """An application answering clefcore's routes from ``service`` (whose start and stop stay the caller's).
    ``body_timeout``: seconds from a request's head to the end of its body, 408 after. ``prefix``: the path it
    will be mounted under, if any (``mount`` passes it). An empty ``api_key`` is refused (ValueError): it would
    turn authentication off; None serves without a key."""
    if api_key is not None and not api_key.strip():
        raise ValueError("api_key is empty: an empty key would turn authentication off; pass None to serve "
                         "without a key")
    app = web.Application(middlewares=[_middleware])
    app[SERVICE] = service
    app[HTTP] = http = Http(api_key, max_body_bytes, body_timeout, prefix, RefusalLog())
    app.add_routes([web.route(route.method, route.path, route.handler) for route in ROUTES])

    async def flush_refusals(app: web.Application) -> None:   # the last second's 429s get their line
        http.refusals.flush()
    app.on_cleanup.append(flush_refusals)
    app.on_response_prepare.append(_server_header)
    return app


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    # aiohttp would send its own and Python's versions: a scanner's shortcut to the known holes of each
    response.headers["Server"] = "clefcore"


def mount(parent: web.Application, prefix: str, service: Service, *, api_key: str | None = None,
          max_body_bytes: int = MAX_BODY_BYTES, body_timeout: float = BODY_TIMEOUT) -> web.Application:
    """Answer clefcore's routes under ``prefix`` (e.g. "/clef": POST /clef/v1/systemone, GET /clef/health) in
    ``parent``, an application of the caller's, as a sub-application; returns it. The parent's runner should
    pass ``handler_cancellation=True`` (a client that leaves frees its queue slot) and ``auto_decompress=False``
    (compressed bodies are decoded here, within the body limit)."""
    prefix = "/" + prefix.strip("/")
    if prefix == "/":
        raise ValueError("mount needs a prefix such as /clef; at the root, serve build_app(service) itself")
    app = build_app(service, api_key=api_key, max_body_bytes=max_body_bytes, body_timeout=body_timeout,
                    prefix=prefix)
    parent.add_subapp(prefix, app)
    return app
