"""Request-body content codings: gzip (and its old name x-gzip), deflate, br and zstd, the set aiohttp
decodes when Brotli and zstd are installed (both are clefcore dependencies; zstd is in the standard library
from Python 3.14, backports.zstd before).

The server decodes bodies itself rather than through aiohttp's ``auto_decompress``, because aiohttp answers
some broken streams (a truncated deflate stream, a missing decoder) from inside its HTTP parser with a
bare text 400 that never reaches our handler, and lets a truncated br or zstd stream end as an empty body.
Here every failure is an exception with the reason, and what one body may cost is bounded: the decoded size
(a few KiB that would inflate to gigabytes stop at ``limit + 1`` bytes), at most ``MAX_CODINGS`` codings and
``MAX_MEMBERS`` gzip members or zstd frames, none of them empty, a deadline, and the client's presence
(``Limits``).

Decoding takes time linear in the body: a decoder is fed slices of at most ``STEP`` bytes of the body (or of the
coding below's output) and asked for at most ``STEP`` bytes of output at a time, never handed a copy of all the
input that remains (that made a body of many tiny gzip members cost the square of their number). Between steps
it checks the deadline and whether the client has left.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

try:
    import brotli  # Brotli >= 1.2 (output_buffer_limit); a dependency on CPython
except ImportError:
    brotli = None

try:
    if sys.version_info >= (3, 14):
        from compression.zstd import DecompressionParameter, ZstdDecompressor, ZstdError
    else:
        from backports.zstd import DecompressionParameter, ZstdDecompressor, ZstdError
except ImportError:
    ZstdDecompressor = None

# In the order a client should prefer them; sent back in Accept-Encoding with a 415 (RFC 7694).
DECODED = tuple(name for name, present in (("zstd", ZstdDecompressor is not None), ("br", brotli is not None),
                                           ("gzip", True), ("deflate", True)) if present)
_ALIASES = {"x-gzip": "gzip"}  # RFC 9110 8.4.1.3

MAX_CODINGS = 2       # codings stacked in one Content-Encoding; real clients apply one (urllib3 and undici allow 5)
MAX_MEMBERS = 64      # gzip members (deflate: zlib streams) or zstd frames in one body; real clients send one
STEP = 1 << 16        # bytes of input fed to a decoder at a time, and of output asked of it
ZSTD_WINDOW_LOG = 23  # RFC 9659: a zstd content coding's window is at most 8 MiB (the library would take 128 MiB)

Chunk = bytes | memoryview   # a step's input: a slice of the body, or a piece of the stage below's output


def deadline_s(limit: int) -> float:
    """Seconds that decoding a body of up to ``limit`` decoded bytes may take. Every coding decodes 13 MiB in
    under 0.1 s on one core (3 to 60 ms measured); this allows 5 MB/s, 20 times slower, and at least 1 s."""
    return max(1.0, limit / 5e6)


class CodingError(ValueError):
    """The bytes are not a complete stream of the coding they claim, or they hold more than is allowed."""


class TooLarge(Exception):
    """The decoded body is longer than the limit."""


class TooSlow(Exception):
    """Decoding did not end by its deadline."""


class Stopped(Exception):
    """Decoding was given up because its client left."""


@dataclass(frozen=True)
class Limits:
    """What decoding one body may cost: ``decoded_bytes`` of output, ``seconds`` from when decoding starts (not
    from when it was asked for: it may wait for a thread). ``stop`` is set when the client leaves."""
    decoded_bytes: int
    seconds: float
    stop: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def for_limit(cls, decoded_bytes: int) -> "Limits":
        return cls(decoded_bytes, deadline_s(decoded_bytes))


class _Run:
    """One decoding under its Limits: the output cap, and the checks made between steps."""

    def __init__(self, limits: Limits):
        self.cap = limits.decoded_bytes + 1   # decoding stops here: too large
        self._deadline = time.monotonic() + limits.seconds
        self._stop = limits.stop

    def check(self) -> None:
        if self._stop.is_set():
            raise Stopped()
        if time.monotonic() >= self._deadline:
            raise TooSlow()


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


def decode(data: bytes, codings: list[str], limits: Limits) -> bytes:
    """Undo the codings (at most MAX_CODINGS, as ``parse`` gave them), last applied first. Raises CodingError,
    TooLarge, TooSlow or Stopped."""
    run = _Run(limits)
    view = memoryview(data)
    stream: Iterator[Chunk] = (view[i:i + STEP] for i in range(0, len(view), STEP))
    for name in reversed(codings):
        # stacked codings decode as a pipeline: each asks the one below for a step's output only when it needs
        # more input, so a bad inner stream is refused before the outer one is decoded in full
        stream = _STAGES[name](stream, run, name)
    return b"".join(stream)


class _Member(Protocol):
    """A decoder of one gzip member, zlib stream, zstd frame or br stream."""

    def feed(self, data: Chunk, room: int) -> bytes:
        """Decode ``data`` (b"" while ``pending``) into at most about ``room`` bytes; CodingError if invalid."""

    @property
    def ended(self) -> bool:
        """The member is complete."""

    @property
    def pending(self) -> bool:
        """It holds output, or input, to give before it takes more input."""

    @property
    def unused(self) -> bytes:
        """Once ended: what of the last input lay past the member's end (the next member's start)."""


def _members(stream: Iterator[Chunk], run: _Run, new: Callable[[], _Member], name: str, unit: str,
             most: int = MAX_MEMBERS) -> Iterator[bytes]:
    """Decode ``stream``: one or more concatenated members (RFC 1952 2.2, RFC 8878 3), each by a ``new()``
    decoder, a step's output at a time, at most ``run.cap`` bytes in all."""
    total = members = 0
    start = next(stream, None)   # the next member's first bytes
    while start is not None:
        members += 1
        if members > most:
            raise CodingError(f"more than {most} {name} {unit}s in one body" if most > 1 else
                              f"data after the end of the {name} {unit}")
        member, before, data = new(), total, start
        while True:
            run.check()
            piece = member.feed(data, min(STEP, run.cap - total))   # >= 1: zlib reads 0 as unbounded
            if piece:
                total += len(piece)
                if total >= run.cap:
                    raise TooLarge()
                yield piece
            if member.ended:
                break
            data = b"" if member.pending else next(stream, None)
            if data is None:
                raise CodingError(f"the {name} stream is truncated")
        if total == before:
            raise CodingError(f"a {name} {unit} decodes to nothing")
        start = member.unused or next(stream, None)
    if total == 0:
        raise CodingError(f"the {name} stream decodes to nothing")


class _Zlib:
    def __init__(self, wbits: int, name: str):
        self._d = zlib.decompressobj(wbits)
        self._name = name
        self.pending = False

    def feed(self, data: Chunk, room: int) -> bytes:
        d = self._d
        try:  # a full output may leave input (unconsumed_tail, a piece of one step) or output inside zlib
            piece = d.decompress(d.unconsumed_tail or data, room)
        except zlib.error as error:
            raise CodingError(f"invalid {self._name} data ({error})") from None
        self.pending = not d.eof and (len(piece) >= room or bool(d.unconsumed_tail))
        return piece

    @property
    def ended(self) -> bool:
        return self._d.eof

    @property
    def unused(self) -> bytes:
        return self._d.unused_data


class _Zstd:
    def __init__(self):
        self._d = ZstdDecompressor(options={DecompressionParameter.window_log_max: ZSTD_WINDOW_LOG})

    def feed(self, data: Chunk, room: int) -> bytes:
        try:
            return self._d.decompress(data, room)
        except ZstdError as error:
            raise CodingError(f"invalid zstd data ({error})") from None

    @property
    def ended(self) -> bool:
        return self._d.eof

    @property
    def pending(self) -> bool:
        return not self._d.eof and not self._d.needs_input

    @property
    def unused(self) -> bytes:
        return self._d.unused_data


class _Brotli:
    unused = b""   # a br stream followed by more bytes in the same input is an error (brotli.error)

    def __init__(self):
        self._d = brotli.Decompressor()
        self.pending = False

    def feed(self, data: Chunk, room: int) -> bytes:
        d = self._d
        try:
            piece = d.process(data, output_buffer_limit=room)
        except brotli.error as error:
            raise CodingError(f"invalid br data ({error})") from None
        # brotli takes in all the input it is given and may hold output back: drain that before new input,
        # so that what it holds stays within one step
        self.pending = not d.is_finished() and (bool(piece) or not d.can_accept_more_data())
        return piece

    @property
    def ended(self) -> bool:
        return self._d.is_finished()


def _gzip(stream: Iterator[Chunk], run: _Run, name: str) -> Iterator[bytes]:
    return _members(stream, run, lambda: _Zlib(16 + zlib.MAX_WBITS, name), name, "member")


def _deflate(stream: Iterator[Chunk], run: _Run, name: str) -> Iterator[bytes]:
    # RFC 9110's deflate is a zlib stream; some clients send the bare DEFLATE data. A zlib stream starts
    # with a header whose method nibble is 8 and whose first two bytes are a multiple of 31 (RFC 1950).
    first = list(itertools.islice(stream, 2))   # a piece of the stage below's output may be 1 byte
    head = b"".join(bytes(chunk[:2]) for chunk in first)[:2]
    wrapped = len(head) == 2 and head[0] & 0x0F == 8 and ((head[0] << 8) | head[1]) % 31 == 0
    wbits = zlib.MAX_WBITS if wrapped else -zlib.MAX_WBITS
    return _members(itertools.chain(first, stream), run, lambda: _Zlib(wbits, name), name, "stream")


def _br(stream: Iterator[Chunk], run: _Run, name: str) -> Iterator[bytes]:
    return _members(stream, run, _Brotli, name, "stream", most=1)


def _zstd(stream: Iterator[Chunk], run: _Run, name: str) -> Iterator[bytes]:
    return _members(stream, run, _Zstd, name, "frame")


_STAGES = {"gzip": _gzip, "deflate": _deflate, "br": _br, "zstd": _zstd}
