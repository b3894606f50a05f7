"""Request-body content codings: gzip (and its old name x-gzip), deflate, br and zstd, the set aiohttp
decodes when Brotli and zstd are installed (both are clefcore dependencies; zstd is in the standard library
from Python 3.14, backports.zstd before).

The server decodes bodies itself rather than through aiohttp's ``auto_decompress``, because aiohttp answers
some broken streams (a truncated deflate stream, a missing decoder) from inside its HTTP parser with a
bare text 400 that never reaches our handler, and lets a truncated br or zstd stream end as an empty body.
Here every failure is a ``CodingError`` with the reason, and the decoded size is capped: a few KiB that
would inflate to gigabytes stop at ``limit + 1`` bytes.
"""

from __future__ import annotations

import sys
import zlib

try:
    import brotli  # Brotli >= 1.2 (output_buffer_limit); a dependency on CPython
except ImportError:
    brotli = None

try:
    if sys.version_info >= (3, 14):
        from compression.zstd import ZstdDecompressor, ZstdError
    else:
        from backports.zstd import ZstdDecompressor, ZstdError
except ImportError:
    ZstdDecompressor = None

# In the order a client should prefer them; sent back in Accept-Encoding with a 415 (RFC 7694).
DECODED = tuple(name for name, present in (("zstd", ZstdDecompressor is not None), ("br", brotli is not None),
                                           ("gzip", True), ("deflate", True)) if present)
_ALIASES = {"x-gzip": "gzip"}  # RFC 9110 8.4.1.3


class CodingError(ValueError):
    """The bytes are not a complete stream of the coding they claim."""


class TooLarge(Exception):
    """The decoded body is longer than the limit."""


def parse(header: str) -> list[str] | None:
    """The codings named by a Content-Encoding header, in the order they were applied; [] for none,
    None when one of them is not decoded here."""
    codings = []
    for name in header.lower().split(","):
        name = _ALIASES.get(name.strip(), name.strip())
        if name in ("", "identity"):
            continue
        if name not in DECODED:
            return None
        codings.append(name)
    return codings


def decode(data: bytes, codings: list[str], limit: int) -> bytes:
    """Undo the codings, last applied first. Raises CodingError or TooLarge."""
    for name in reversed(codings):
        data = _DECODERS[name](data, limit + 1)
        if len(data) > limit:
            raise TooLarge()
        if not data:
            raise CodingError(f"the {name} stream decodes to nothing")
    return data


def _zlib(data: bytes, cap: int, wbits: int, name: str) -> bytes:
    """One or more concatenated zlib/gzip members (a gzip file may hold several, RFC 1952 2.2)."""
    out = bytearray()
    while True:
        d = zlib.decompressobj(wbits)
        try:
            out += d.decompress(data, cap - len(out))
        except zlib.error as error:
            raise CodingError(f"invalid {name} data ({error})") from None
        if len(out) >= cap:
            return bytes(out)
        if not d.eof:
            raise CodingError(f"the {name} stream is truncated")
        data = d.unused_data
        if not data:
            return bytes(out)


def _gzip(data: bytes, cap: int) -> bytes:
    return _zlib(data, cap, 16 + zlib.MAX_WBITS, "gzip")


def _deflate(data: bytes, cap: int) -> bytes:
    # RFC 9110's deflate is a zlib stream; some clients send the bare DEFLATE data. A zlib stream starts
    # with a header whose method nibble is 8 and whose first two bytes are a multiple of 31 (RFC 1950).
    wrapped = len(data) >= 2 and data[0] & 0x0F == 8 and ((data[0] << 8) | data[1]) % 31 == 0
    return _zlib(data, cap, zlib.MAX_WBITS if wrapped else -zlib.MAX_WBITS, "deflate")


def _br(data: bytes, cap: int) -> bytes:
    d = brotli.Decompressor()
    try:
        out = d.process(data, output_buffer_limit=cap)
    except brotli.error as error:
        raise CodingError(f"invalid br data ({error})") from None
    if len(out) < cap and not d.is_finished():
        raise CodingError("the br stream is truncated")
    return out


def _zstd(data: bytes, cap: int) -> bytes:
    """One or more concatenated zstd frames."""
    out = bytearray()
    while True:
        d = ZstdDecompressor()
        try:
            out += d.decompress(data, cap - len(out))
        except ZstdError as error:
            raise CodingError(f"invalid zstd data ({error})") from None
        if len(out) >= cap:
            return bytes(out)
        if not d.eof:
            raise CodingError("the zstd stream is truncated")
        data = d.unused_data
        if not data:
            return bytes(out)


_DECODERS = {"gzip": _gzip, "deflate": _deflate, "br": _br, "zstd": _zstd}
