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
        self.max_chars_per_token = _max_chars_per_token(spec)   # None: no bound, the state is never cut

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


# Normalizers and pre-tokenizers that never fold more than COMPOSED_PER_BYTE characters into a byte nor drop text:
# canonical and compatibility forms (NFC and NFKC compose at most three characters into two bytes, U+0055 U+0308
# U+0304 -> U+01D5), byte-level encoding, and splits that keep what they split on.
_BOUNDED_NORMALIZERS = {"NFC", "NFKC", "NFD", "NFKD"}
_BOUNDED_SPLITS = {"ByteLevel", "Split", "Digits", "Punctuation"}
COMPOSED_PER_BYTE = 2


def _max_chars_per_token(spec: dict) -> int | None:
    """The most characters of text that one token can stand for, or None where that has no bound this module
    can prove. A byte-level BPE (every byte has a token, so none is unknown) stands for at most its longest
    vocabulary entry or added token in bytes of normalized text (a byte-level vocabulary writes each byte as one
    character), and its normalizer folds at most COMPOSED_PER_BYTE characters into a byte. A tokenizer that may
    drop text (a split that removes what it splits on, a normalizer of another kind) or meet unknown characters
    has no such bound."""
    def steps(node: dict | None, key: str) -> list[dict]:
        if node is None:
            return []
        return [step for child in node[key] for step in steps(child, key)] if node["type"] == "Sequence" else [node]

    normalizers = steps(spec.get("normalizer"), "normalizers")
    splits = steps(spec.get("pre_tokenizer"), "pretokenizers")
    byte_level = (spec["model"]["type"] == "BPE" and (spec.get("decoder") or {}).get("type") == "ByteLevel"
                  and any(step["type"] == "ByteLevel" for step in splits))
    if (not byte_level or any(step["type"] not in _BOUNDED_NORMALIZERS for step in normalizers)
            or any(step["type"] not in _BOUNDED_SPLITS or str(step.get("behavior", "")).lower() == "removed"
                   for step in splits)):
        return None
    longest = max(map(len, spec["model"]["vocab"]), default=1)
    added = (len(token["content"].encode("utf-8")) for token in spec.get("added_tokens") or ())
    return COMPOSED_PER_BYTE * max([longest, *added])
