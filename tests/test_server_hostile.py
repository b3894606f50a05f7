"""Hostile clients against a real `clefcore serve` (tiny model, CPU, the default --max-body-bytes): bodies whose
content coding costs more than their size says, and clients that send a request's head or body a byte at a time.
Each is answered or closed within its bound, and a normal request beside them keeps its usual time."""

from __future__ import annotations

import gzip
import http.client
import json
import socket
import statistics
import sys
import time

import pytest

from server_harness import SUPPORT_TICKET, Server, until

if sys.version_info >= (3, 14):
    from compression import zstd
else:
    zstd = pytest.importorskip("backports.zstd")

HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 1.5
TRICKLE_S = 0.1   # a byte every 0.1 s: the pace of the attack, not a wait for the server


@pytest.fixture(scope="module")
def server():
    with Server("--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT)) as s:
        s.wait_ready()
        assert s.decide(SUPPORT_TICKET).status == 200   # one measured body: later ones are held at an estimate
        yield s


# --- bodies that cost more than their size ---------------------------------------------------------------------

def gzip_members_bomb() -> bytes:
    """gzip around 100,000 empty gzip members: 4.9 KB sent, 2 MB once the outer coding is undone."""
    return gzip.compress(gzip.compress(b"") * 100_000)


def zstd_frames_bomb() -> bytes:
    """gzip around 100,000 one-byte zstd frames."""
    return gzip.compress(zstd.compress(b" ") * 100_000)


BOMBS = {"gzip, gzip": gzip_members_bomb, "zstd, gzip": zstd_frames_bomb}


def send(server: Server, data: bytes, encoding: str) -> http.client.HTTPConnection:
    """The whole request is written when this returns; its answer is read with getresponse()."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/systemone", body=data,
                 headers={"Content-Type": "application/json", "Content-Encoding": encoding})
    return conn


@pytest.mark.parametrize("encoding", sorted(BOMBS))
def test_many_member_bombs_are_refused_within_a_second(server, encoding):
    data = BOMBS[encoding]()
    assert len(data) < 20_000
    started = time.monotonic()
    conn = send(server, data, encoding)
    reply = conn.getresponse()
    error = json.loads(reply.read())["error"]
    conn.close()
    assert time.monotonic() - started < 1.0
    assert reply.status == 400, error
    assert error["field"] == "Content-Encoding"
    assert "decodes to nothing" in error["message"] or "more than 64" in error["message"], error


def test_a_normal_request_beside_two_bombs_keeps_its_time(server):
    def normal() -> float:
        started = time.monotonic()
        reply = server.decide(SUPPORT_TICKET)
        assert reply.status == 200, reply
        return time.monotonic() - started

    made = {encoding: make() for encoding, make in BOMBS.items()}   # made here, not while it is timed
    normal()
    alone = statistics.median(normal() for _ in range(7))
    beside = []
    for _ in range(7):
        bombs = [send(server, data, encoding) for encoding, data in made.items()]   # sent before it
        beside.append(normal())
        for conn in bombs:
            assert conn.getresponse().status in (400, 413)
            conn.close()
    assert statistics.median(beside) < 2 * alone, (alone, beside)


def test_too_many_stacked_codings_get_400(server):
    data = gzip.compress(gzip.compress(gzip.compress(json.dumps(SUPPORT_TICKET).encode())))
    reply = server.post("/v1/systemone", data, headers={"Content-Encoding": "gzip, gzip, gzip"})
    assert reply.status == 400, reply
    error = reply.json()["error"]
    assert error["field"] == "Content-Encoding" and error["limit"] == "2 codings", error


# --- slow clients -----------------------------------------------------------------------------------------------

def trickle(sock: socket.socket, data: bytes) -> tuple[bytes, float]:
    """Send ``data`` a byte at a time until the server answers or closes; (what it sent back, seconds taken).
    The socket is left open."""
    sock.setblocking(False)
    started, answer = time.monotonic(), b""
    try:
        for byte in data:
            try:
                sock.send(bytes([byte]))
            except OSError:   # closed under us
                break
            time.sleep(TRICKLE_S)
            try:
                answer = sock.recv(65536)
            except BlockingIOError:
                continue
            break
        else:
            raise AssertionError(f"the server still waits after {time.monotonic() - started:.1f} s")
        return answer, time.monotonic() - started
    finally:
        sock.setblocking(True)


def until_closed(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def timed_out(answer: bytes, seconds: float, part: str) -> None:
    """``answer`` is a 408 that closes the connection, naming the deadline of ``part`` (header or body)."""
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"Connection: close" in head, answer
    error = json.loads(body)["error"]
    assert error["type"] == "timeout" and error["limit"] == f"{seconds:g} s" and part in error["message"]


def test_a_trickled_head_gets_408_and_is_closed_at_its_deadline(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        answer, took = trickle(sock, b"POST /v1/systemone HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Slow: y\r\n" * 50)
        answer += until_closed(sock)
    assert HEADER_TIMEOUT - 0.1 <= took < HEADER_TIMEOUT + 1.0, took
    timed_out(answer, HEADER_TIMEOUT, "header")
    server.wait_for_events("head_timeout", lambda events: events)
    assert server.events("head_timeout")


def test_a_connection_that_sends_nothing_is_closed_at_the_head_deadline(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        started = time.monotonic()
        assert until_closed(sock) == b""   # nothing was asked: nothing is answered
        took = time.monotonic() - started
    assert HEADER_TIMEOUT - 0.1 <= took < HEADER_TIMEOUT + 1.0, took


def test_an_idle_kept_alive_connection_is_not_cut_by_the_head_deadline(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("GET", "/live")
        assert conn.getresponse().read()
        sock = conn.sock
        time.sleep(2 * HEADER_TIMEOUT)   # idle between requests: the keep-alive timeout's business
        conn.request("GET", "/live")
        reply = conn.getresponse()
        assert reply.status == 200 and reply.read()
        assert conn.sock is sock          # the same connection
        # a request whose body is sent just after its head, on a connection kept alive past the deadline
        conn.request("POST", "/v1/systemone", body=json.dumps(SUPPORT_TICKET),
                     headers={"Content-Type": "application/json"})
        assert conn.getresponse().status == 200 and conn.sock is sock
    finally:
        conn.close()


def test_a_trickled_body_gets_408_at_its_deadline_and_gives_up_its_place(server):
    body = json.dumps(SUPPORT_TICKET).encode()
    head = (b"POST /v1/systemone HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    assert server.metric("clef_held_tokens") == 0
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head + body[:1])
        # while the body is read, its estimated tokens are held as work ahead of later arrivals
        until(lambda: server.metric("clef_held_tokens") > 0, BODY_TIMEOUT, "tokens held for the body")
        answer, took = trickle(sock, body[1:])
        assert took < BODY_TIMEOUT + 1.0, took
        timed_out(answer, BODY_TIMEOUT, "body")
        assert server.metric("clef_held_tokens") == 0   # released before the answer was sent
        sock.sendall(body)    # the rest, and more: the server reads no further request on this connection
        assert until_closed(sock) == b""
    lines = server.wait_for_events("request", lambda events: any(e["status"] == 408 for e in events))
    (line,) = [e for e in lines if e["status"] == 408]
    # at the deadline, not before it (uvloop's timers run on a clock of whole milliseconds)
    assert line["error"] == "timeout" and line["duration_ms"] >= BODY_TIMEOUT * 1000 - 2


def test_still_serving(server):
    assert server.decide(SUPPORT_TICKET).status == 200
    assert server.metric("clef_requests_total", 'status="500"') == 0
