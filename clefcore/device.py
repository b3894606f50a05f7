"""One device a --device value names (``cpu``, ``cuda`` or ``cuda:N``), parsed here for every command and the
server."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ClefError


@dataclass(frozen=True)
class Device:
    kind: str          # "cpu" or "cuda"
    index: int = 0     # the GPU's ordinal among those visible ("cuda" is GPU 0); 0 on the CPU

    @classmethod
    def parse(cls, text: str) -> "Device":
        """``text`` as a Device; ClefError naming the field and the forms it takes otherwise."""
        if text == "cpu":
            return cls("cpu")
        kind, colon, index = text.partition(":")
        if kind == "cuda" and not colon:
            return cls("cuda")
        if kind == "cuda" and index.isascii() and index.isdigit():
            return cls("cuda", int(index))
        raise ClefError(f"device must be cpu, cuda or cuda:N (N a GPU index, 0 or more), got {text!r}")
