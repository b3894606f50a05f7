"""Reading a request body: media type, content coding, size, time, JSON. Every way a body can be unusable ends
as an ApiError naming the reason: 415 (media type, unknown coding), 413 (too large, on the wire or decoded, or
too slow to decode), 408 (not received by its deadline), 400 (broken stream or framing, too many codings or
members, not JSON)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from typing import Any

from aiohttp import web

from clefcore.errors import RequestError
from clefcore.jsonvalue import parse_body

from . import codings, errors


async def read_json(request: web.Request, limit: int, executor: Executor, timeout_s: float) -> Any:
    """The body as JSON, received within ``timeout_s`` of the request's start (``request["started"]``, set by
    the routes' middleware with the ``log`` it fills)."""
    if request.content_type != "application/json":
        raise errors.unsupported_media_type(request.headers.get("Content-Type", ""))
    header = request.headers.get("Content-Encoding", "")
    applied = codings.parse(header)
    if applied is None:
        raise errors.unsupported_encoding(header, codings.DECODED)
    if len(applied) > codings.MAX_CODINGS:
        raise errors.too_many_codings(header, len(applied), codings.MAX_CODINGS)
    encoding = ", ".join(applied)
    if encoding:
        request["log"]["content_encoding"] = encoding
    if request.content_length is not None and request.content_length > limit:
        raise errors.body_too_large(limit, request.content_length)
    data = await _read(request, limit, timeout_s)
    if applied:
        data = await _decode(data, applied, encoding, limit, executor)
    request["log"]["bytes_in"] = len(data)
    try:
        return parse_body(data)
    except RequestError as error:
        raise errors.malformed_body(error, encoding) from None


async def _read(request: web.Request, limit: int, timeout_s: float) -> bytes:
    # A client that trickles its body keeps its place ahead of later arrivals (the Service's Arrival) only
    # until its deadline.
    try:
        return await asyncio.wait_for(_chunks(request, limit), request["started"] + timeout_s - time.monotonic())
    except asyncio.TimeoutError:
        raise errors.body_timeout(timeout_s) from None
    except web.RequestPayloadError as error:  # a broken chunked framing
        raise errors.unreadable_body(error) from None


async def _chunks(request: web.Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > limit:  # chunked uploads have no Content-Length: count as we read
            raise errors.body_too_large(limit, None)
        chunks.append(chunk)
    return b"".join(chunks)


async def _decode(data: bytes, applied: list[str], encoding: str, limit: int, executor: Executor) -> bytes:
    limits = codings.Limits.for_limit(limit)
    loop = asyncio.get_running_loop()
    try:  # decompressing up to --max-body-bytes is CPU work: off the event loop
        return await loop.run_in_executor(executor, codings.decode, data, applied, limits)
    except codings.TooLarge:
        raise errors.body_too_large(limit, None, decoded=True) from None
    except codings.TooSlow:
        raise errors.decoding_too_slow(encoding, limits.seconds) from None
    except codings.CodingError as error:
        raise errors.invalid_coding(encoding, error) from None
    finally:
        limits.stop.set()   # the handler was cancelled (its client left): the thread stops at its next step
