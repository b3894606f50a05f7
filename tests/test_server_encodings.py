"""Request bodies in every content coding aiohttp decodes (gzip, deflate, br, zstd), on both decision routes:
the answer is the one the same body gets uncompressed. What still cannot be read gets a 4xx that names the
coding, a body that inflates past --max-body-bytes gets a 413, and the server keeps answering."""

from __future__ import annotations

import asyncio
import gzip
import json
import random
import sys
import time
import zlib

import pytest

from clefcore.server import codings, errors

from server_harness import SUPPORT_TICKET, Server, ticket

brotli = pytest.importorskip("brotli")
if sys.version_info >= (3, 14):
    from compression import zstd
else:
    zstd = pytest.importorskip("backports.zstd")

LIMIT = 20000
CF = "/client/v4/accounts/0123abc/ai/run/@cf/cloudflare/clef"


def raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return c.compress(data) + c.flush()


ENCODERS = {
    "gzip": gzip.compress,
    "deflate": zlib.compress,       # RFC 9110's deflate: a zlib stream
    "br": brotli.compress,
    "zstd": zstd.compress,
}


@pytest.fixture(scope="module")
def server():
    with Server("--max-body-bytes", str(LIMIT)).wait_ready() as s:
        yield s


@pytest.fixture(scope="module")
def body() -> bytes:
    return json.dumps(ticket("Checkout fails for every customer. " * 40)).encode()


@pytest.fixture(scope="module")
def plain(server, body):
    reply = server.decide(body)
    assert reply.status == 200, reply
    return reply.json()


def send(server, data: bytes, encoding: str, path: str = "/v1/systemone"):
    return server.post(path, data, headers={"Content-Encoding": encoding})


# Beside the four codings: some clients send "deflate" as a bare DEFLATE stream (no zlib header); "x-gzip" is gzip's
# old alias; stacked codings are listed in the order they were applied (RFC 9110 8.4).
@pytest.mark.parametrize("encoding, encode", [
    *sorted(ENCODERS.items()),
    ("GZIP", gzip.compress), (" zstd ", zstd.compress), ("Br", brotli.compress), ("identity", lambda b: b),
    ("deflate", raw_deflate), ("x-gzip", gzip.compress),
    ("gzip, br", lambda b: brotli.compress(gzip.compress(b))),
])
def test_each_coding_alias_and_stack_answers_like_the_plain_body(server, body, plain, encoding, encode):
    data = encode(body)
    reply = send(server, data, encoding)
    assert reply.status == 200, reply
    assert reply.json() == plain
    if encode is ENCODERS.get(encoding):     # one of the four: it compresses, and the log line names it
        assert len(data) < len(body)
        rid = reply.headers["x-request-id"]
        seen = server.wait_for_events("request", lambda events: any(e["request_id"] == rid for e in events))
        (line,) = [e for e in seen if e["request_id"] == rid]
        assert line["content_encoding"] == encoding and line["bytes_in"] == len(body)


@pytest.mark.parametrize("encoding", sorted(ENCODERS))
def test_cloudflare_route_decodes_too(server, body, encoding):
    reply = send(server, ENCODERS[encoding](body), encoding, CF)
    assert reply.status == 200, reply
    assert reply.json() == server.post(CF, body).json()


@pytest.mark.parametrize("encoding", sorted(ENCODERS))
def test_corrupt_or_truncated_streams_get_400_naming_the_coding(server, body, plain, encoding):
    whole = ENCODERS[encoding](body)
    for data in (b"this is not " + encoding.encode(), whole[: len(whole) // 2]):
        reply = send(server, data, encoding)
        assert reply.status == 400, (encoding, reply)
        error = reply.json()["error"]
        assert encoding in error["message"], error
        assert reply.json()["detail"]["error_type"] == "invalid_request"
    assert server.decide(body).json() == plain  # nothing else is disturbed


def test_corrupt_stream_on_the_cloudflare_route(server):
    reply = send(server, b"\x1f\x8b not really gzip", "gzip", CF)
    assert reply.status == 400
    (error,) = reply.json()["errors"]
    assert error["code"] == 6003 and "gzip" in error["message"]


@pytest.mark.parametrize("encoding", ["compress", "snappy", "gzip, compress"])
def test_other_codings_get_415(server, body, encoding):
    reply = send(server, gzip.compress(body), encoding)
    assert reply.status == 415, reply
    error = reply.json()["error"]
    assert error["field"] == "Content-Encoding" and repr(encoding) in error["message"]
    assert set(reply.headers["accept-encoding"].split(", ")) == set(ENCODERS)


@pytest.mark.parametrize("encoding", sorted(ENCODERS))
def test_a_small_body_that_inflates_past_the_limit_gets_413(server, encoding):
    huge = json.dumps(ticket(" " * (LIMIT * 50))).encode()
    data = ENCODERS[encoding](huge)
    assert len(data) < LIMIT
    reply = send(server, data, encoding)
    assert reply.status == 413, reply
    error = reply.json()["error"]
    assert "decoded" in error["message"] and error["limit"] == f"{LIMIT} bytes"


def test_no_500_and_still_healthy(server):
    assert server.metric("clef_requests_total", 'status="500"') == 0
    assert server.get("/health").status == 200
    assert server.decide(SUPPORT_TICKET).status == 200


# --- the decoder itself (clefcore.server.codings) -----------------------------------------------------------

limits = codings.Limits.for_limit
LONG = json.dumps([str(i) * (i % 50) for i in range(40_000)]).encode()   # ~1 MB, compresses ~10x


@pytest.mark.parametrize("data", [bytes(range(256)) * 8, LONG], ids=["short", "long"])
def test_decoder_gives_back_what_was_encoded_and_stops_at_the_limit(data):
    """Exactly at the limit is fine, one byte less is TooLarge: for a short body, and for one of many decoder steps
    (output held inside a decoder)."""
    for name, encode in ENCODERS.items():
        assert codings.decode(encode(data), [name], limits(len(data))) == data
        with pytest.raises(codings.TooLarge):
            codings.decode(encode(data), [name], limits(len(data) - 1))
    assert codings.decode(raw_deflate(data), ["deflate"], limits(len(data))) == data


def test_decoder_members_and_garbage():
    data = bytes(range(256)) * 8
    # gzip members and zstd frames may be concatenated; both are one body.
    assert codings.decode(gzip.compress(data) + gzip.compress(data), ["gzip"], limits(10**6)) == data * 2
    assert codings.decode(zstd.compress(data) + zstd.compress(data), ["zstd"], limits(10**6)) == data * 2
    with pytest.raises(codings.CodingError, match="gzip"):
        codings.decode(gzip.compress(data) + b"trailing junk", ["gzip"], limits(10**6))
    # one br stream only: what follows it is refused, inside the decoder's step or after it
    with pytest.raises(codings.CodingError, match="invalid br data"):
        codings.decode(brotli.compress(data) + brotli.compress(data), ["br"], limits(10**6))
    noise = random.Random(0).randbytes(codings.STEP)
    whole_step = next(brotli.compress(noise[:n]) for n in range(codings.STEP - 64, codings.STEP)
                      if len(brotli.compress(noise[:n])) == codings.STEP)
    with pytest.raises(codings.CodingError, match="data after the end of the br stream"):
        codings.decode(whole_step + brotli.compress(data), ["br"], limits(10**6))
    assert codings.parse(" GZIP , br ") == ["gzip", "br"] and codings.parse("identity") == []
    assert codings.parse("gzip, compress") is None


def test_long_members_end_inside_the_decoders_slices():
    assert len(LONG) > 10 * codings.STEP
    for name in ("gzip", "zstd"):
        odd = ENCODERS[name](LONG) + ENCODERS[name](b"[1]") + ENCODERS[name](LONG)
        assert codings.decode(odd, [name], limits(10**7)) == LONG + b"[1]" + LONG


def test_stacked_codings_decode_as_a_pipeline():
    """The inner coding asks the outer one for more only as it needs it: a bad inner stream is refused before the
    outer one is decoded in full (here, before its cut-off end is reached), and a good one decodes whole."""
    for inner, outer in (("gzip", "br"), ("zstd", "gzip"), ("br", "deflate")):
        data = ENCODERS[outer](ENCODERS[inner](LONG))
        assert codings.decode(data, [inner, outer], limits(len(LONG))) == LONG
    cut = gzip.compress(gzip.compress(b"") * 100_000)[:-100]
    with pytest.raises(codings.CodingError, match="a gzip member decodes to nothing"):
        codings.decode(cut, ["gzip", "gzip"], limits(13 * 1024 * 1024))
    with pytest.raises(codings.CodingError, match="the gzip stream is truncated"):
        codings.decode(cut, ["gzip"], limits(13 * 1024 * 1024))


@pytest.mark.parametrize("name", ["gzip", "deflate", "zstd"])
def test_decoder_caps_members_and_refuses_empty_ones(name):
    encode = ENCODERS[name]
    most = codings.MAX_MEMBERS
    assert codings.decode(encode(b"a") * most, [name], limits(10**6)) == b"a" * most
    unit = {"gzip": "member", "deflate": "stream", "zstd": "frame"}[name]
    with pytest.raises(codings.CodingError, match=f"more than {most} {name} {unit}s"):
        codings.decode(encode(b"a") * (most + 1), [name], limits(10**6))
    with pytest.raises(codings.CodingError, match=f"a {name} {unit} decodes to nothing"):
        codings.decode(encode(b"a") + encode(b""), [name], limits(10**6))


@pytest.mark.parametrize("name", ["gzip", "zstd"])
def test_many_member_bombs_are_refused_in_linear_time(name):
    """100,000 members (2 MB, within 13 MiB decoded) are refused at the cap: without it, and with each member's
    decoder handed a copy of all the input left, this body took about 13 s."""
    encode = ENCODERS[name]
    for member in (b"", b" "):
        bomb = encode(member) * 100_000
        started = time.perf_counter()
        with pytest.raises(codings.CodingError):
            codings.decode(bomb, [name], limits(13 * 1024 * 1024))
        assert time.perf_counter() - started < 0.1


def test_decoder_stops_at_its_deadline_and_when_told():
    data = gzip.compress(b"{}" * 100_000)
    with pytest.raises(codings.TooSlow):
        codings.decode(data, ["gzip"], codings.Limits(10**6, seconds=0.0))
    gone = limits(10**6)
    gone.stop.set()
    with pytest.raises(codings.Stopped):
        codings.decode(data, ["gzip"], gone)
    assert codings.deadline_s(13 * 1024 * 1024) > 1.0 and codings.deadline_s(1000) == 1.0


def test_zstd_windows_over_8_mib_are_refused():
    """RFC 9659 caps a zstd content coding's window at 8 MiB; a larger one would cost its memory per body."""
    data = bytes(range(256)) * 40_000   # 10 MB
    wide = zstd.compress(data, options={zstd.CompressionParameter.window_log: 24})
    with pytest.raises(codings.CodingError, match="zstd"):
        codings.decode(wide, ["zstd"], limits(len(data)))
    narrow = zstd.compress(data, options={zstd.CompressionParameter.window_log: 23})
    assert codings.decode(narrow, ["zstd"], limits(len(data))) == data


class _Threads:
    """The prepare threads as body.decode sees them (``on_threads``): they keep what they were given and run
    nothing; a call raises ``outcome``, or never returns (None)."""

    def __init__(self, outcome: BaseException | None = None):
        self.calls = []
        self.outcome = outcome

    async def __call__(self, nbytes, fn):
        self.calls.append(fn)
        if self.outcome is not None:
            raise self.outcome
        await asyncio.get_running_loop().create_future()


def test_a_client_that_leaves_stops_its_decoding(monkeypatch):
    """The handler is cancelled when its client disconnects; the decoding thread is told to stop."""
    from clefcore.server import body

    threads, seen = _Threads(), []
    monkeypatch.setattr(body.codings, "decode", lambda data, applied, limits: seen.append(limits))

    async def leave():
        task = asyncio.ensure_future(body.decode(body.Body(gzip.compress(b"{}"), ("gzip",), "gzip"), 1000, threads))
        while not threads.calls:
            await asyncio.sleep(0)
        threads.calls[0]()          # what the thread would run: the decoding, with its limits
        (limits,) = seen
        assert not limits.stop.is_set()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return limits

    assert asyncio.run(leave()).stop.is_set()


def test_decoding_past_its_deadline_gets_413_naming_it():
    from clefcore.server import body

    with pytest.raises(errors.ApiError) as refused:
        asyncio.run(body.decode(body.Body(b"x", ("br",), "br"), 13 * 1024 * 1024, _Threads(codings.TooSlow())))
    error = refused.value
    seconds = codings.deadline_s(13 * 1024 * 1024)
    assert error.status == 413 and error.limit == f"{seconds:g} s decoding", error.bare_body()
    assert f"longer than {seconds:g} s to decode" in error.message
