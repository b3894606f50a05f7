"""A one-line progress bar on stderr, shown only when stderr is a terminal (logs stay clean)."""

from __future__ import annotations

import sys


def terminal_bar(label: str = "loading"):
    """A ``progress(done, total, what)`` callback for ``load_params`` / ``synth.write``, or None off a terminal."""
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int, what: str) -> None:
        width = 30
        fill = width * done // max(total, 1)
        sys.stderr.write(f"\r{label} [{'#' * fill}{'.' * (width - fill)}] {done}/{total}")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()
    return show
