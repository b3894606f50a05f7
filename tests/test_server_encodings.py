"""Request bodies in every content coding aiohttp decodes (gzip, deflate, br, zstd), on both decision routes:
the answer is the one the same body gets uncompressed. What still cannot be read gets a 4xx that names the
coding, a body that inflates past --max-body-bytes gets a 413, and the server keeps answering."""

from __future__ import annotations

import gzip
import json
import sys
import zlib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from server_harness import SUPPORT_TICKET, Server, ticket  # noqa: E402

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
    with Server("--max-body-bytes", str(LIMIT)) as s:
        s.wait_ready()
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


@pytest.mark.parametrize("encoding", sorted(ENCODERS))
def test_each_coding_answers_like_the_plain_body(server, body, plain, encoding):
    data = ENCODERS[encoding](body)
    assert len(data) < len(body)
    reply = send(server, data, encoding)
    assert reply.status == 200, reply
    assert reply.json() == plain
    rid = reply.headers["x-request-id"]
    seen = server.wait_for_events("request", lambda events: any(e["request_id"] == rid for e in events))
    (line,) = [e for e in seen if e["request_id"] == rid]
    assert line["content_encoding"] == encoding and line["bytes_in"] == len(body)


@pytest.mark.parametrize("encoding", ["GZIP", " zstd ", "Br", "identity"])
def test_coding_names_are_case_and_space_insensitive(server, body, plain, encoding):
    name = encoding.strip().lower()
    data = body if name == "identity" else ENCODERS[name](body)
    reply = send(server, data, encoding)
    assert reply.status == 200, reply
    assert reply.json() == plain


def test_raw_deflate_without_the_zlib_header(server, body, plain):
    # Some clients send "deflate" as a bare DEFLATE stream; aiohttp detects it by the missing zlib header.
    reply = send(server, raw_deflate(body), "deflate")
    assert reply.status == 200 and reply.json() == plain


@pytest.mark.parametrize("encoding", sorted(ENCODERS))
def test_cloudflare_route_decodes_too(server, encoding):
    body = json.dumps(ticket("Checkout fails for every customer. " * 40, model="clef")).encode()
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


def test_stacked_codings_and_the_x_gzip_alias(server, body, plain):
    # Content-Encoding lists codings in the order they were applied (RFC 9110 8.4).
    stacked = send(server, brotli.compress(gzip.compress(body)), "gzip, br")
    assert stacked.status == 200 and stacked.json() == plain
    assert send(server, gzip.compress(body), "x-gzip").json() == plain


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

def test_decoder_limits_members_and_garbage():
    from clefcore.server import codings

    data = bytes(range(256)) * 8
    for name, encode in ENCODERS.items():
        assert codings.decode(encode(data), [name], len(data)) == data  # exactly at the limit is fine
        with pytest.raises(codings.TooLarge):
            codings.decode(encode(data), [name], len(data) - 1)
    # gzip members and zstd frames may be concatenated; both are one body.
    assert codings.decode(gzip.compress(data) + gzip.compress(data), ["gzip"], 10**6) == data * 2
    assert codings.decode(zstd.compress(data) + zstd.compress(data), ["zstd"], 10**6) == data * 2
    with pytest.raises(codings.CodingError, match="gzip"):
        codings.decode(gzip.compress(data) + b"trailing junk", ["gzip"], 10**6)
    assert codings.parse(" GZIP , br ") == ["gzip", "br"] and codings.parse("identity") == []
    assert codings.parse("gzip, compress") is None
