"""Piece-wise tokenization with the checkpoint's ``tokenizer.json`` (clef-head.md §3.5).

The reference tokenizes through transformers, whose Qwen tokenizer classes keep only the vocabulary,
merges and added tokens of the file and rebuild NFC plus a hard-coded Split regex; which regex depends on
the transformers version. ``regex=None`` trusts the file; ``"qwen2"``/``"qwen35"`` rebuild that pipeline
with the named regex, to match a particular reference setup on text with combining marks.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

# transformers 5.10 Qwen2Tokenizer vs 5.24 Qwen3_5Tokenizer: they differ only in \p{M} (combining marks).
SPLIT_REGEX = {  # verbatim patterns
    "qwen2": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",  # noqa: E501
    "qwen35": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",  # noqa: E501
}
_CACHE_LIMIT = 4096  # only template pieces and "OPTION j: " are cached; a bound all the same


class Tokenizer:
    def __init__(self, path: str | Path, regex: str | None = None):
        spec = json.loads(Path(path).read_text(encoding="utf-8"))
        if regex is not None:
            if regex not in SPLIT_REGEX:
                raise ValueError(f"regex must be None, 'qwen2' or 'qwen35', got {regex!r}")
            spec["normalizer"] = {"type": "NFC"}
            spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": SPLIT_REGEX[regex]}, "behavior": "Isolated",
                 "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            ]}
        self._tok = _HFTokenizer.from_str(json.dumps(spec))
        self._constants: dict[str, list[int]] = {}
        self.longest_token_bytes = _longest_token_bytes(spec)

    def encode_pieces(self, pieces: list[str]) -> list[list[int]]:
        """Each piece on its own, no BOS/EOS; added tokens (``<|im_end|>``...) are matched in any text."""
        if not pieces:
            return []
        return [e.ids for e in self._tok.encode_batch(pieces, add_special_tokens=False)]

    def encode_constant(self, piece: str) -> list[int]:
        """Like ``encode_pieces([piece])[0]`` but memoised; for template pieces. Do not mutate the result."""
        ids = self._constants.get(piece)
        if ids is None:
            ids = self.encode_pieces([piece])[0]
            if len(self._constants) < _CACHE_LIMIT:
                self._constants[piece] = ids
        return ids


def _longest_token_bytes(spec: dict) -> int:
    """The most bytes of text one token can stand for: its longest vocabulary entry or added token. A byte-level
    vocabulary writes each byte as one character; any other spells its text out (or more: byte fallbacks,
    word-piece markers), so its UTF-8 length bounds the text it matches."""
    vocab = spec["model"]["vocab"]
    pieces = vocab.keys() if isinstance(vocab, dict) else (piece for piece, _ in vocab)   # Unigram: [piece, score]
    byte_level = (spec.get("decoder") or {}).get("type") == "ByteLevel"
    longest = max((len(p) if byte_level else len(p.encode("utf-8")) for p in pieces), default=1)
    return max([longest, *(len(t["content"].encode("utf-8")) for t in spec.get("added_tokens") or ())])
