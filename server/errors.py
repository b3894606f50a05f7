"""Error responses: one exception type inside the server, two wire shapes outside.

Our bare routes answer ``{"error": {"message", "type", "field"?, "limit"?, ...}, "detail": {"message",
"error_type"}}``: the ``error`` object is what OpenAI-style and bobcat-style clients read, ``detail`` is the
FastAPI-style body TypeSafe SDKs parse (systemone-protocol.md §8.2, §14.6). The Cloudflare route answers
Cloudflare's envelope with its numeric codes (§7, §8.1); validation refusals nest the AiError JSON in
``message`` exactly like Workers AI does, so clients that parse that nesting (neurolink) keep working.
"""

from __future__ import annotations

import json

from clefcore.errors import BodyTooLargeError, ContextLengthError, ImageTokensError, PromptTokensError, RequestError

from .admission import Reason, Refusal

# TypeSafe's `detail.error_type` vocabulary; our own kinds map onto it.
_TYPESAFE_KIND = {
    "invalid_request_error": "invalid_request",
    "invalid_json": "invalid_request",
    "invalid_content_encoding": "invalid_request",
    "unsupported_content_encoding": "invalid_request",
    "invalid_body": "invalid_request",
    "exceed_context_size_error": "tokens_exceeded",
    "authentication_error": "authentication_error",
    "timeout": "timeout",
}

# Cloudflare Workers AI error codes (systemone-protocol.md §8.1). 3040 is what Workers AI sends when it
# sheds load; we use it for every "try again later" answer, 503 included.
CF_BAD_INPUT = 5006
CF_VALIDATION = 5012
CF_NOT_JSON = 6003
CF_NO_ROUTE = 7000
CF_UNAUTHORIZED = 10000
CF_TOO_LARGE = 5021
CF_CAPACITY = 3040
CF_INFERENCE_FAILED = 5012
# The kinds of the 5xx answers below (unavailable, timed_out, inference_failed, internal): the values of
# clef_request_failures_total's `type` label.
SERVER_KINDS = ("unavailable_error", "timeout", "device_error", "internal_error")


class ApiError(Exception):
    """An HTTP error answer. ``extra`` goes into the bare ``error`` object (token counts for context
    overflows); ``headers`` are sent as they are (``Retry-After``); ``close``: the connection ends after it."""

    def __init__(self, status: int, message: str, kind: str, *, cf_code: int, field: str | None = None,
                 limit: str | None = None, extra: dict | None = None, headers: dict | None = None,
                 cf_nested: bool = False, cf_status: int | None = None, close: bool = False):
        super().__init__(message)
        self.status = status
        self.cf_status = cf_status or status
        self.message = message
        self.kind = kind
        self.cf_code = cf_code
        self.field = field
        self.limit = limit
        self.extra = extra or {}
        self.headers = headers or {}
        self.cf_nested = cf_nested
        self.close = close

    def bare_body(self) -> dict:
        error = {"message": self.message, "type": self.kind}
        if self.field:
            error["field"] = self.field
        if self.limit is not None:
            error["limit"] = self.limit
        error.update(self.extra)
        return {"error": error,
                "detail": {"message": self.message, "error_type": _TYPESAFE_KIND.get(self.kind, self.kind)}}

    def cloudflare_body(self, request_id: str) -> dict:
        if self.cf_nested:
            field_errors = {self.field: [self.message]} if self.field else {}
            nested = {"error": {"type": "invalid_request", "message": "Request body failed validation",
                                "details": {"formErrors": [] if self.field else [self.message],
                                            "fieldErrors": field_errors}}}
            message = f"AiError: AiError: {json.dumps(nested, ensure_ascii=False)} ({request_id})"
        else:
            message = f"AiError: {self.message} ({request_id})"
        return {"errors": [{"message": message, "code": self.cf_code}], "success": False, "result": {},
                "messages": []}


def malformed_body(err: RequestError, encoding: str = "") -> ApiError:
    """A body that is not JSON (400), or holds more than a body may (BodyTooLargeError: 413)."""
    message = f"request body (decoded from {encoding}): {err.message}" if encoding else err.message
    if isinstance(err, BodyTooLargeError):
        return ApiError(413, message, err.type, cf_code=CF_TOO_LARGE, limit=err.limit)
    return ApiError(400, message, "invalid_json", cf_code=CF_NOT_JSON, field=err.field or None,
                    limit=err.limit)


def invalid_request(err: RequestError) -> ApiError:
    """A body the engine refused. Context overflows are 400 with llama.cpp-style token counts
    (serving-and-peers.md §5a); images over the server's image-token limits and prompts over its prompt-token
    limit 413; every other rule is a 422
    schema violation. On the Cloudflare route a
    missing top-level property or an unknown question type is Workers AI's 400/5006, the rest 422/5012."""
    if isinstance(err, ContextLengthError):
        return ApiError(400, err.message, err.type, cf_code=CF_TOO_LARGE, field=err.field, limit=err.limit,
                        extra={"n_prompt_tokens": err.required, "n_ctx": err.maximum})
    if isinstance(err, (ImageTokensError, PromptTokensError)):   # more device time than this server allows
        return ApiError(413, err.message, err.type, cf_code=CF_TOO_LARGE, field=err.field, limit=err.limit)
    field = err.field or ""
    if (field in ("model", "state", "questions") and "required" in err.message) or field.endswith(".type"):
        return ApiError(422, err.message, err.type, cf_code=CF_BAD_INPUT, field=field or None,
                        limit=err.limit, cf_status=400)
    return ApiError(422, err.message, err.type, cf_code=CF_VALIDATION, field=field or None,
                    limit=err.limit, cf_nested=True)


def unsupported_media_type(content_type: str) -> ApiError:
    return ApiError(415, f"Content-Type must be application/json, got {content_type or 'none'}",
                    "unsupported_media_type", cf_code=CF_NOT_JSON, limit="application/json")


def body_too_large(limit: int, size: int | None, decoded: bool = False) -> ApiError:
    got = f"{size} bytes" if size is not None else f"more than {limit} bytes"
    what = "request body, decoded," if decoded else "request body"
    return ApiError(413, f"{what} is {got}; the limit is {limit} bytes", "request_too_large",
                    cf_code=CF_TOO_LARGE, limit=f"{limit} bytes")


def unsupported_encoding(encoding: str, decoded: tuple[str, ...]) -> ApiError:
    """415 names the coding and, in Accept-Encoding, the ones we decode (RFC 9110 15.5.16, RFC 7694)."""
    accepted = ", ".join(decoded)
    return ApiError(415, f"Content-Encoding {encoding!r} is not supported; send one of {accepted} or none",
                    "unsupported_content_encoding", cf_code=CF_NOT_JSON, field="Content-Encoding",
                    limit=accepted, headers={"Accept-Encoding": accepted})


def invalid_coding(encoding: str, error: Exception) -> ApiError:
    return ApiError(400, f"request body is not valid {encoding} data (Content-Encoding: {encoding}): {error}",
                    "invalid_content_encoding", cf_code=CF_NOT_JSON, field="Content-Encoding", limit=encoding)


def too_many_codings(encoding: str, count: int, most: int) -> ApiError:
    return ApiError(400, f"Content-Encoding {encoding!r} stacks {count} codings; at most {most} are decoded",
                    "invalid_content_encoding", cf_code=CF_NOT_JSON, field="Content-Encoding",
                    limit=f"{most} codings")


def decoding_too_slow(encoding: str, seconds: float) -> ApiError:
    return ApiError(413, f"request body (Content-Encoding: {encoding}) took longer than {seconds:g} s to decode; "
                         f"the limit is {seconds:g} s", "request_too_large", cf_code=CF_TOO_LARGE,
                    field="Content-Encoding", limit=f"{seconds:g} s decoding")


def body_timeout(timeout_s: float) -> ApiError:
    """The body did not all arrive within --body-timeout of the request's head: the connection ends after this."""
    return ApiError(408, f"request body was not received within {timeout_s:g} s (--body-timeout)", "timeout",
                    cf_code=CF_BAD_INPUT, limit=f"{timeout_s:g} s", close=True)


def head_timeout(timeout_s: float) -> ApiError:
    """The request line and headers did not all arrive within --header-timeout (server/head_deadline.py)."""
    return ApiError(408, f"request headers were not received within {timeout_s:g} s (--header-timeout)",
                    "timeout", cf_code=CF_BAD_INPUT, limit=f"{timeout_s:g} s")


def unreadable_body(error: Exception) -> ApiError:
    """The body's framing is broken (chunked transfer coding): aiohttp's reason, on its last line."""
    lines = str(error).strip().splitlines()
    reason = lines[-1].strip() if lines else type(error).__name__
    return ApiError(400, f"request body could not be read: {reason}", "invalid_body", cf_code=CF_NOT_JSON)


def unauthorized() -> ApiError:
    return ApiError(401, "missing or invalid API key (send Authorization: Bearer <key> or X-Api-Key)",
                    "authentication_error", cf_code=CF_UNAUTHORIZED,
                    headers={"WWW-Authenticate": 'Bearer realm="clefcore"'})


def refused(refusal: Refusal, capacity: int) -> ApiError:
    """Admission refused the request (``refusal``; ``capacity``: the queue's bound in requests): a 429 whose
    body names the reason. The queue full, or the work ahead of it would outlast the wait budget; or, evicted,
    it had been queued, and cheaper work admitted since pushed its answer past the budget."""
    retry = {"Retry-After": str(refusal.retry_after_s)}
    if refusal.reason is Reason.QUEUE_FULL:
        return ApiError(429, f"server queue is full ({capacity} requests); retry later", "rate_limit_error",
                        cf_code=CF_CAPACITY, limit=f"{capacity} queued requests",
                        extra={"reason": refusal.reason.value}, headers=retry)
    what = ("cheaper work admitted since this request was queued" if refusal.reason is Reason.EVICTED
            else "the work already queued")
    wait_s, budget_s = refusal.wait_s, refusal.budget_s
    return ApiError(429, f"server is overloaded: {what} means an expected wait of {wait_s:.2f} s, over the "
                         f"{budget_s:g} s wait budget; retry in {refusal.retry_after_s} s",
                    "rate_limit_error", cf_code=CF_CAPACITY, limit=f"{budget_s:g} s expected wait",
                    extra={"reason": refusal.reason.value, "expected_wait_s": round(wait_s, 3)}, headers=retry)


def unavailable(reason: str, retry_after_s: int) -> ApiError:
    return ApiError(503, f"server is {reason}", "unavailable_error", cf_code=CF_CAPACITY,
                    extra={"reason": reason}, headers={"Retry-After": str(retry_after_s)})


def timed_out(timeout_s: float) -> ApiError:
    return ApiError(503, f"request waited longer than {timeout_s:g} s for the model; retry later", "timeout",
                    cf_code=CF_CAPACITY, limit=f"{timeout_s:g} s", headers={"Retry-After": "1"})


def inference_failed(err: Exception) -> ApiError:
    return ApiError(500, f"inference failed: {err}", "device_error", cf_code=CF_INFERENCE_FAILED)


def internal(err: Exception) -> ApiError:
    return ApiError(500, f"internal server error ({type(err).__name__})", "internal_error",
                    cf_code=CF_INFERENCE_FAILED)


def not_found(path: str) -> ApiError:
    return ApiError(404, f"no route for {path}", "not_found_error", cf_code=CF_NO_ROUTE)


def method_not_allowed(method: str, allowed: str) -> ApiError:
    return ApiError(405, f"method {method} not allowed (allowed: {allowed})", "method_not_allowed",
                    cf_code=CF_NO_ROUTE, headers={"Allow": allowed})


def no_cloudflare_model(model: str) -> ApiError:
    return ApiError(400, f"No route for that URI (@cf/cloudflare/{model} is not served here; "
                         "use clef or clef-flash)", "invalid_request_error", cf_code=CF_NO_ROUTE,
                    field="model", limit="clef or clef-flash")


def model_mismatch(body_model: object, path_model: str) -> ApiError:
    return ApiError(400, f"model: body model {json.dumps(body_model)} does not match the model in the "
                         f"path ({path_model})", "invalid_request_error", cf_code=CF_BAD_INPUT, field="model",
                    limit=path_model)
