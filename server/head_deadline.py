"""Deadlines that aiohttp's server lacks: on each request's head (request line and headers), and on each write.

The head: aiohttp bounds a head's size, not the time it takes, so a client that sends one byte of it now and
then holds its connection forever. ``listen`` accepts connections for an AppRunner the way aiohttp's TCPSite
does, but each connection's aiohttp protocol is wrapped in ``Deadlines``. Its head clock starts when the
connection opens and, on a kept-alive connection, at the first byte after the previous request (its handler
done and its body all received: body bytes that arrive later are the previous request's, not a head); it stops
when the next request reaches the handler (``track``, a middleware). When it runs out the connection is closed,
after a 408 if any of a head had arrived. An idle kept-alive connection is not timed here: aiohttp's keep-alive
timeout closes it. Bytes that arrive while a request is being handled (a pipelined next request) start no clock
either; a connection that sends them faster than it reads its answers ends at the write deadline.

The writes: a client that sends requests and never reads the answers would keep its connection, and what is
written to it, forever. The kernel holds at most ``SEND_BUFFER`` (doubled) of a connection's unread bytes and
the transport ``WRITE_BUFFER`` more, after which the transport asks the protocol to pause writing; the write
clock runs while it is paused, and when the client has not taken any of the bytes that wait within the write
timeout (nginx's ``send_timeout``, 60 s by default), the connection is aborted: what waits is dropped.
"""

from __future__ import annotations

import asyncio
import json
import socket

from aiohttp import web

from . import errors
from .logs import log

SEND_BUFFER = 256 * 1024    # SO_SNDBUF of a connection (the kernel doubles it); answers are a few KB
WRITE_BUFFER = 64 * 1024    # the transport's high-water mark: past it, writing pauses and the write clock runs


class Deadlines(asyncio.Protocol):
    """aiohttp's protocol for one connection, with a deadline on each request's head and on each write."""

    def __init__(self, inner: asyncio.Protocol, timeout_s: float, write_timeout_s: float):
        self._inner = inner
        self._timeout_s = timeout_s
        self._write_timeout_s = write_timeout_s
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None   # runs while writing is paused
        self._head_bytes = False   # some of a head arrived since the clock started
        self._handling = False     # a request is in the handler
        self._body_open = False    # the last request's body has not all arrived

    # --- asyncio's calls, passed on ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        transport.set_write_buffer_limits(high=WRITE_BUFFER)
        self._start_clock()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self._handling and not self._body_open:
            self._head_bytes = True
            if self._timer is None:
                self._start_clock()
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_clock()
        self._stop_write_clock()
        self._transport = None
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._write_timer is None:
            self._write_timer = asyncio.get_running_loop().call_later(self._write_timeout_s, self._write_expired)
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._stop_write_clock()   # the client took some: it is reading
        self._inner.resume_writing()

    # --- the middleware's calls -----------------------------------------------------------------------------
    def request_started(self, request: web.BaseRequest) -> None:
        self._stop_clock()
        self._handling = self._body_open = True
        request.content.on_eof(self._body_ended)   # called at once when the body has already ended

    def request_ended(self) -> None:
        self._handling = False

    def _body_ended(self) -> None:
        self._body_open = False

    # --- the clock ------------------------------------------------------------------------------------------
    def _start_clock(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(self._timeout_s, self._expired)

    def _stop_clock(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._head_bytes = False

    def _expired(self) -> None:
        self._timer = None
        transport = self._transport
        if transport is None:
            return
        if self._head_bytes:
            error = errors.head_timeout(self._timeout_s)
            body = json.dumps(error.bare_body()).encode()
            transport.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
                            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
            log("head_timeout", client=_peer(transport), timeout_s=self._timeout_s)
        transport.close()   # what was written is sent first

    def _stop_write_clock(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_expired(self) -> None:
        self._write_timer = None
        transport = self._transport
        if transport is None:
            return
        log("write_timeout", client=_peer(transport), timeout_s=self._write_timeout_s,
            waiting_bytes=transport.get_write_buffer_size())
        transport.abort()   # the client takes nothing: what waits for it is dropped, not sent first


def _peer(transport: asyncio.BaseTransport) -> str | None:
    peer = transport.get_extra_info("peername")
    return peer[0] if isinstance(peer, tuple) else peer


@web.middleware
async def track(request: web.Request, handler) -> web.StreamResponse:
    """Tells the connection's Deadlines that its request's head has arrived, and when the handler is done."""
    transport = request.transport
    if transport is None:   # the client is already gone
        return await handler(request)
    connection: Deadlines = transport.get_protocol()   # listen() serves the application ``track`` is in
    connection.request_started(request)
    try:
        return await handler(request)
    finally:
        connection.request_ended()


async def listen(runner: web.AppRunner, host: str, port: int, *, reuse_port: bool,
                 head_timeout_s: float, write_timeout_s: float) -> asyncio.AbstractServer:
    """Accept connections on host:port for ``runner`` (set up, its application given ``track``), as aiohttp's
    TCPSite would, with a head and a write deadline on each. The caller closes the server before
    ``runner.cleanup()``."""
    protocol = runner.server
    if protocol is None:
        raise RuntimeError("listen needs a runner that was set up")
    return await asyncio.get_running_loop().create_server(
        lambda: Deadlines(protocol(), head_timeout_s, write_timeout_s), host, port, backlog=128,
        reuse_port=reuse_port)
