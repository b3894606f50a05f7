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

from clefcore.errors import RequestError

MAX_DEPTH = 64  # nested objects/arrays; far beyond any real request, far below the recursion limit
KEY_SHOWN = 64
_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_body(data: bytes | str) -> Any:
    """Parse a request body; every failure is a ``RequestError``."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(f"request body is not valid UTF-8 (byte {e.start}: {e.reason})") from None
    try:
        value = json.loads(data)
    except json.JSONDecodeError as e:
        raise RequestError(f"malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise RequestError(f"JSON nested deeper than {MAX_DEPTH} levels",
                           limit=f"{MAX_DEPTH} levels") from None
    except ValueError:  # the only other ValueError: an int literal beyond sys.get_int_max_str_digits()
        limit = sys.get_int_max_str_digits()
        raise RequestError(f"JSON integer literal longer than {limit} digits",
                           limit=f"{limit} digits") from None
    _check_tree(value)
    return value


def _check_tree(root: Any) -> None:
    """Iteratively (so nothing here can recurse too deep) enforce the depth limit and reject lone
    surrogates, which ``\\ud800`` escapes can produce but UTF-8 and the tokenizer cannot carry."""
    stack = [(root, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise RequestError(f"{path or 'body'}: string contains a lone UTF-16 surrogate", field=path)
            continue
        if isinstance(value, float) and not math.isfinite(value):
            # NaN/Infinity literals and overflowing numbers (1e400) could not be echoed back as JSON
            raise RequestError(f"{path or 'body'}: number is not finite (NaN, Infinity or beyond 1.8e308)",
                               field=path, limit="finite double")
        if not isinstance(value, (dict, list)):
            continue
        if depth == MAX_DEPTH:
            raise RequestError(f"{path or 'body'}: JSON nested deeper than {MAX_DEPTH} levels",
                               field=path, limit=f"{MAX_DEPTH} levels")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in items:
            if isinstance(key, str) and _SURROGATE.search(key):
                raise RequestError(f"{path or 'body'}: object key contains a lone UTF-16 surrogate",
                                   field=path)
            stack.append((child, join_path(path, key), depth + 1))


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
