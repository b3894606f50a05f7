"""Request → token ids and spans, exactly as the reference ``encode_record`` (clef-head.md §3).

Every piece is tokenized on its own (token boundaries are forced at piece boundaries), the schema is
built first, and only the state is cut to fit ``context_length``. A request with images gets one
``<|vision_start|>`` + pads + ``<|vision_end|>`` block per image and a ``\n`` right after ``STATE:\n`` (clef-head.md
§3.8, clef-images.md §7); those tokens count toward ``context_length`` and the positions become M-RoPE's [3, L].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from clefcore.errors import ContextLengthError, RequestError
from clefcore.jsonvalue import render
from clefcore.tokenize import Tokenizer

SYSTEM_PROMPT = ("Read the complete state and schema. Decide every field jointly. "
                 "Each answer must be exactly one of that field's allowed options.")
PREFIX = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\nSTATE:\n"
SCHEMA_HEAD = "\n\nSCHEMA FIELDS:\n"
OPTIONS_HEAD = "\nALLOWED OPTIONS:\n"
OPTION_END = "\n"
FIELD_END = "END FIELD\n"
SUFFIX = "\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nJOINT SCHEMA DECISIONS:"
NOUL_DEFAULTS = {
    "true": "The proposition is true or the answer is yes.",
    "false": "The proposition is false or the answer is no.",
}
TYPE_INDEX = {"noul": 0, "choice": 1, "score": 2}
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
MERGE = 2   # the vision tower merges 2x2 patches into one token


def field_head(index: int, question_id: str, question_type: str) -> str:
    # 1-based index; id and type go in raw, unescaped, as in the reference.
    return f"\nFIELD {index}\nID: {question_id}\nTYPE: {question_type}\nINSTRUCTION: "


def option_head(index: int) -> str:
    return f"OPTION {index}: "


def instruction_text(question_id: str, question: dict) -> str:
    # Only null and "" fall back to the id: 0, false, [] and {} are rendered.
    instructions = question.get("instructions")
    if instructions is None or instructions == "":
        return question_id
    return render(instructions)


def question_options(question: dict) -> list[tuple[str, Any]]:
    """(option id, description) in model (= logit) order; a None description is left out of the prompt."""
    criteria = question.get("criteria")
    if question["type"] == "noul":
        # Defaults overridden key by key; an explicit null removes the description; other keys ignored.
        given = criteria or {}
        return [(key, given.get(key, default)) for key, default in NOUL_DEFAULTS.items()]
    if question["type"] == "choice":
        return sorted(criteria.items(), key=lambda item: item[0])  # code-point order, not request order
    return [(str(index), level) for index, level in enumerate(criteria)]


def option_text(option_id: str, description: Any) -> str:
    semantics = {"option_id": option_id}
    if description is not None:
        semantics["description"] = description
    return render(semantics)


@dataclass(frozen=True)
class EncodedQuestion:
    id: str
    type: str                       # "noul" | "choice" | "score"
    type_index: int                 # 0, 1, 2
    question_span: tuple[int, int]  # half-open, into input_ids
    option_ids: tuple[str, ...]     # model (= logit) order
    option_spans: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class EncodedRecord:
    input_ids: np.ndarray           # int32 [L]
    questions: tuple[EncodedQuestion, ...]   # request order
    state_span: tuple[int, int]
    state_tokens_before_truncation: int   # of its text up to the cut (state_text_cut): all of it, below the cut
    state_truncated: bool
    # with images only: each image's (pads start, pads end, merged grid rows, merged grid columns), the M-RoPE
    # positions [3, L] int64, and the images' preprocessed pixels (clefcore.preprocess.Pixels) in request order
    image_spans: tuple[tuple[int, int, int, int], ...] = ()
    positions: np.ndarray | None = None
    images: tuple = ()
    state_cut: bool = False       # its text was longer than the cut: state_tokens_before_truncation is a floor


# Tokens beyond the kept ones that the text cut leaves before it: what the cut changes (the last pre-tokenizer
# word, an added token or a normalizer's composition cut in two) lies within a few tokens of it.
CUT_MARGIN_TOKENS = 64


def state_text_cut(room: int, max_chars_per_token: int | None) -> int | None:
    """The characters of a state's text that are tokenized when ``room`` of its tokens can be kept (None: all of
    them, where the tokenizer gives no bound). The kept tokens stand for at most ``room * max_chars_per_token``
    characters of the text (``Tokenizer.max_chars_per_token``), and the margin after them absorbs what the cut
    changes, so the kept tokens are those of the whole text, and a state of any length costs at most this much
    to tokenize."""
    return None if max_chars_per_token is None else max_chars_per_token * (room + CUT_MARGIN_TOKENS)


class Encoder:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def encode(self, request: dict, context_length: int, images: tuple = ()) -> EncodedRecord:
        """Encode a request normalised by ``validate_request``; raises ``ContextLengthError`` when the
        prompt without its state is longer than ``context_length``. ``images``: the request's preprocessed images
        (``clefcore.preprocess.Pixels``, request order); their placeholders go before the state."""
        tok = self.tokenizer
        plans = []   # per question: (id, type, option ids)
        pieces = []  # the request-dependent pieces, tokenized in one batch
        for index, (question_id, question) in enumerate(request["questions"].items(), 1):
            options = question_options(question)
            plans.append((question_id, question["type"], tuple(option_id for option_id, _ in options)))
            pieces.append(field_head(index, question_id, question["type"]))
            pieces.append(instruction_text(question_id, question))
            pieces.extend(option_text(option_id, description) for option_id, description in options)
        encoded = iter(tok.encode_pieces(pieces))

        # Spans are measured inside the schema first and shifted once the kept state length is known.
        schema = list(tok.encode_constant(SCHEMA_HEAD))
        spans = []
        for _, _, option_ids in plans:
            schema += next(encoded)
            start = len(schema)
            schema += next(encoded)
            question_span = (start, len(schema))
            schema += tok.encode_constant(OPTIONS_HEAD)
            option_spans = []
            for number in range(1, len(option_ids) + 1):
                schema += tok.encode_constant(option_head(number))
                start = len(schema)
                schema += next(encoded)
                option_spans.append((start, len(schema)))
                schema += tok.encode_constant(OPTION_END)
            schema += tok.encode_constant(FIELD_END)
            spans.append((question_span, option_spans))

        prefix = tok.encode_constant(PREFIX)
        media, image_spans = self._media(images, len(prefix))
        prefix = prefix + media            # the media sit between STATE:\n and the state, counted as fixed
        suffix = tok.encode_constant(SUFFIX)
        fixed = len(prefix) + len(schema) + len(suffix)
        if fixed > context_length:
            raise ContextLengthError(f"schema requires {fixed} tokens before state; maximum is {context_length}",
                                     required=fixed, maximum=context_length)
        text = render(request["state"])
        cut = state_text_cut(context_length - fixed, tok.max_chars_per_token)
        cut_off = cut is not None and len(text) > cut
        state = tok.encode_pieces([text[:cut] if cut_off else text])[0]   # the text past the cut costs nothing
        kept = state[:context_length - fixed]  # keeps the head; may cut inside a multi-token character
        offset = len(prefix) + len(kept)

        def shift(span: tuple[int, int]) -> tuple[int, int]:
            return (span[0] + offset, span[1] + offset)

        questions = tuple(
            EncodedQuestion(id=question_id, type=question_type, type_index=TYPE_INDEX[question_type],
                            question_span=shift(question_span), option_ids=option_ids,
                            option_spans=tuple(shift(span) for span in option_spans))
            for (question_id, question_type, option_ids), (question_span, option_spans) in zip(plans, spans))
        input_ids = np.array(prefix + kept + schema + suffix, dtype=np.int32)
        positions = None
        if images:
            pad = tok.encode_constant(IMAGE_PAD)[0]
            tokens, features = int(np.count_nonzero(input_ids == pad)), sum(p.num_tokens for p in images)
            if tokens != features:   # a literal <|image_pad|> in the text: transformers' check, its message
                in_state = pad in kept
                raise RequestError(f"Image features and image tokens do not match, tokens: {tokens}, "
                                   f"features: {features}", field="state" if in_state else "questions",
                                   limit=f"no literal {IMAGE_PAD} in the text of a request with images")
            positions = mrope_positions(len(input_ids), image_spans)
        return EncodedRecord(
            input_ids=input_ids,
            questions=questions,
            state_span=(len(prefix), offset),
            state_tokens_before_truncation=len(state),
            state_truncated=len(kept) < len(state),
            image_spans=image_spans,
            positions=positions,
            images=tuple(images),
            state_cut=cut_off,
        )

    def _media(self, images, start: int) -> tuple[list[int], tuple]:
        """The processor's ids for the images (pads expanded) and each image's pad span, starting at ``start``."""
        if not images:
            return [], ()
        tok = self.tokenizer
        vs, pad, ve = (tok.encode_constant(t) for t in (VISION_START, IMAGE_PAD, VISION_END))
        ids, spans = [], []
        for p in images:
            ids += vs
            s = start + len(ids)
            ids += pad * p.num_tokens
            spans.append((s, start + len(ids), p.grid_thw[1] // MERGE, p.grid_thw[2] // MERGE))
            ids += ve
        ids += tok.encode_constant("\n")
        return ids, tuple(spans)


def mrope_positions(length: int, image_spans) -> np.ndarray:
    """M-RoPE (temporal, height, width) positions [3, L] (clef-images.md §9): a text token gets (n, n, n) and
    advances n by 1; an image's pads get (s, s + row, s + col) over its merged grid, row-major, s = the position
    the first pad would have had as text; the token after them continues at s + max(rows, cols)."""
    pos = np.empty((3, length), dtype=np.int64)
    t, n = 0, 0
    for start, end, rows, cols in image_spans:
        pos[:, t:start] = n + np.arange(start - t)
        n += start - t
        r, c = np.divmod(np.arange(end - start), cols)
        pos[0, start:end], pos[1, start:end], pos[2, start:end] = n, n + r, n + c
        n += max(rows, cols)
        t = end
    pos[:, t:] = n + np.arange(length - t)
    return pos
