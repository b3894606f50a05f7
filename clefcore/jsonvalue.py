"""Request-body JSON: parse it like the reference's HTTP layer (CPython ``json``) and render values like
the reference's ``render``.

The stdlib parser already has the semantics the reference assumes: int and float stay distinct, ``1e5`` is
a float, the last duplicate key wins at the position of the first. What it lacks is a guarantee that the
value can later be tokenized and serialized, so ``parse_body`` also rejects what would blow up downstream.
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any

from clefcore.errors import BodyTooLargeError, RequestError

MAX_DEPTH = 64  # nested objects/arrays; far beyond any real request, far below the recursion limit
# Array elements, object members, arrays and objects in one body, counted before it is parsed: this bounds what
# parsing and walking it cost (the parser holds the GIL throughout, ~60 ns an element: ~30 ms for this many).
# An answer sees only the state's first context-length tokens, and a token of a rendered value spans a handful
# of elements at most.
MAX_ELEMENTS = 500_000
KEY_SHOWN = 64
_SURROGATE = re.compile("[\ud800-\udfff]")
# a surrogate escape, or a surrogate in a caller's text: without one, no parsed string can hold a lone surrogate
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')   # a JSON string literal, escapes included
_SEARCH_STEP = 1 << 20   # characters searched for surrogates at a time: the GIL is let go in between


def parse_body(data: bytes | str) -> Any:
    """Parse a request body; every failure is a ``RequestError`` (``BodyTooLargeError`` for MAX_ELEMENTS)."""
    if isinstance(data, str):   # a caller's text: counted and checked for surrogates as its UTF-8
        text, data = data, data.encode("utf-8", "surrogatepass")
    else:
        text, data = None, bytes(data)
    _count_elements(data)
    if text is None:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(f"request body is not valid UTF-8 (byte {e.start}: {e.reason})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(f"malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise RequestError(f"JSON nested deeper than {MAX_DEPTH} levels",
                           limit=f"{MAX_DEPTH} levels") from None
    except ValueError:  # the only other ValueError: an int literal beyond sys.get_int_max_str_digits()
        limit = sys.get_int_max_str_digits()
        raise RequestError(f"JSON integer literal longer than {limit} digits",
                           limit=f"{limit} digits") from None
    _check_tree(value, surrogates=_SURROGATE_ESCAPE.search(data) is not None)
    return value


def _count_elements(data: bytes) -> None:
    """BodyTooLargeError past MAX_ELEMENTS, before anything is built: each comma outside strings separates two
    elements or members and each [ or { opens an array or object, so their number is at most the body's
    elements, members, arrays and objects. Counting them in the whole body is C-speed; only when that count,
    strings' commas and brackets included, is over the limit are the strings taken out for the exact one."""
    def structural(b: bytes) -> int:
        return b.count(b",") + b.count(b"[") + b.count(b"{")
    if structural(data) <= MAX_ELEMENTS or structural(_STRING.sub(b"", data)) <= MAX_ELEMENTS:
        return
    raise BodyTooLargeError(f"request body holds more than {MAX_ELEMENTS} array elements, object members, arrays "
                            f"and objects", limit=f"{MAX_ELEMENTS} elements")


def _check_tree(root: Any, surrogates: bool) -> None:
    """Iteratively (so nothing here can recurse too deep) enforce the depth limit and reject non-finite numbers
    and, where the body had surrogate escapes (``surrogates``), lone surrogates, which UTF-8 and the tokenizer
    cannot carry. Only containers are stacked, each with the chain of keys to it (its path, spelled out only
    for an error): scalars cost one check each."""
    _check_scalar(root, None, surrogates)
    stack = [(root, None, 0)]
    while stack:
        value, where, depth = stack.pop()
        if not isinstance(value, (dict, list)):
            continue
        if depth == MAX_DEPTH:
            path = _path(where)
            raise RequestError(f"{path or 'body'}: JSON nested deeper than {MAX_DEPTH} levels",
                               field=path, limit=f"{MAX_DEPTH} levels")
        if isinstance(value, dict):
            if surrogates:
                for key in value:
                    if _has_surrogate(key):
                        path = _path(where)
                        raise RequestError(f"{path or 'body'}: object key contains a lone UTF-16 surrogate",
                                           field=path)
            items = value.items()
        else:
            items = enumerate(value)
        for key, child in items:
            if isinstance(child, (dict, list)):
                stack.append((child, (where, key), depth + 1))
            elif isinstance(child, (str, float)):
                _check_scalar(child, (where, key), surrogates)


def _check_scalar(value: Any, where: tuple | None, surrogates: bool) -> None:
    if isinstance(value, str):
        if surrogates and _has_surrogate(value):
            path = _path(where)
            raise RequestError(f"{path or 'body'}: string contains a lone UTF-16 surrogate", field=path)
    elif isinstance(value, float) and not math.isfinite(value):
        # NaN/Infinity literals and overflowing numbers (1e400) could not be echoed back as JSON
        path = _path(where)
        raise RequestError(f"{path or 'body'}: number is not finite (NaN, Infinity or beyond 1.8e308)",
                           field=path, limit="finite double")


def _has_surrogate(text: str) -> bool:
    return any(_SURROGATE.search(text, start, start + _SEARCH_STEP)
               for start in range(0, len(text), _SEARCH_STEP))


def _path(where: tuple | None) -> str:
    """The dotted path of a chain of keys ((parent chain, key), or None at the root)."""
    keys = []
    while where is not None:
        where, key = where
        keys.append(key)
    path = ""
    for key in reversed(keys):
        path = join_path(path, key)
    return path


def join_path(path: str, key: str | int) -> str:
    """Dotted field path; list indices in brackets. Keys are client-controlled: each is cut to
    ``KEY_SHOWN`` characters so paths stay short, and surrogates are escaped so the path is valid UTF-8."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    if len(key) > KEY_SHOWN:
        key = key[:KEY_SHOWN] + "..."
    key = key.encode("utf-8", "backslashreplace").decode("utf-8")
    return f"{path}.{key}" if path else key


def render(value: Any) -> str:
    """The reference's text for a JSON value: strings raw, everything else compact sorted JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
