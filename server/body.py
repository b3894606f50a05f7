"""Reading a request body: media type, content coding, size, JSON. Every way a body can be unusable ends
as an ApiError naming the reason: 415 (media type, unknown coding), 413 (too large, on the wire or
decoded), 400 (broken stream or framing, not JSON)."""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Any

from aiohttp import web

from clefcore.errors import RequestError
from clefcore.jsonvalue import parse_body

from . import codings, errors


async def read_json(request: web.Request, limit: int, executor: Executor) -> Any:
    if request.content_type != "application/json":
        raise errors.unsupported_media_type(request.headers.get("Content-Type", ""))
    header = request.headers.get("Content-Encoding", "")
    applied = codings.parse(header)
    if applied is None:
        raise errors.unsupported_encoding(header, codings.DECODED)
    encoding = ", ".join(applied)
    if encoding:
        request["log"]["content_encoding"] = encoding
    if request.content_length is not None and request.content_length > limit:
        raise errors.body_too_large(limit, request.content_length)
    chunks, size = [], 0
    try:
        async for chunk in request.content.iter_chunked(1 << 16):
            size += len(chunk)
            if size > limit:  # chunked uploads have no Content-Length: count as we read
                raise errors.body_too_large(limit, None)
            chunks.append(chunk)
    except web.RequestPayloadError as error:  # a broken chunked framing
        raise errors.unreadable_body(error) from None
    data = b"".join(chunks)
    if applied:
        loop = asyncio.get_running_loop()
        try:  # decompressing up to --max-body-bytes is CPU work: off the event loop
            data = await loop.run_in_executor(executor, codings.decode, data, applied, limit)
        except codings.TooLarge:
            raise errors.body_too_large(limit, None, decoded=True) from None
        except codings.CodingError as error:
            raise errors.invalid_coding(encoding, error) from None
    request["log"]["bytes_in"] = len(data)
    try:
        return parse_body(data)
    except RequestError as error:
        raise errors.malformed_body(error, encoding) from None
