"""Reading a request body: media type, content coding, size, time, JSON. Every way a body can be unusable ends
as an ApiError naming the reason: 415 (media type, unknown coding), 413 (too large, on the wire, decoded or in
elements, or too slow to decode), 408 (not received by its deadline), 400 (broken stream or framing, too many
codings or members, not JSON).

Only receiving happens on the event loop. Decoding (``decode``) and parsing (``parse``) are CPU work that grows
with the body: the caller runs them on the prepare threads, in their turn (``OnThreads``: the Service's
``on_threads``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web

from clefcore.errors import RequestError
from clefcore.jsonvalue import parse_body

from . import codings, errors

T = TypeVar("T")
# fn() on the prepare threads in the turn of a body of nbytes (server/prepare.py), awaited
OnThreads = Callable[[int, Callable[[], T]], Awaitable[T]]


@dataclass(frozen=True)
class Body:
    """A body as received: its bytes, the content codings applied to them (in order) and the header's spelling of
    them ("" for none)."""
    data: bytes
    applied: tuple[str, ...]
    encoding: str


async def receive(request: web.Request, limit: int, timeout_s: float) -> Body:
    """The body, checked for its media type, its codings and its size on the wire, received within ``timeout_s``
    of the request's start (``request["started"]``, set by the routes' middleware with the ``log`` it fills)."""
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
    return Body(await _read(request, limit, timeout_s), tuple(applied), encoding)


async def decode(body: Body, limit: int, on_threads: OnThreads) -> bytes:
    """The body's bytes with its codings undone, within ``limit`` decoded bytes and codings' other limits."""
    limits = codings.Limits.for_limit(limit)
    try:
        return await on_threads(len(body.data), lambda: codings.decode(body.data, list(body.applied), limits))
    except codings.TooLarge:
        raise errors.body_too_large(limit, None, decoded=True) from None
    except codings.TooSlow:
        raise errors.decoding_too_slow(body.encoding, limits.seconds) from None
    except codings.CodingError as error:
        raise errors.invalid_coding(body.encoding, error) from None
    finally:
        limits.stop.set()   # the handler was cancelled (its client left): the thread stops at its next step


def parse(data: bytes, encoding: str) -> Any:
    """The decoded body as JSON (on the prepare threads: its cost grows with the body's size and elements)."""
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
