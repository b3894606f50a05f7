"""The requests ``clefcore bench`` and its transformers peer both run: random token ids with the bench's
questions, and the one-image request laid out as the engine lays it out."""

from __future__ import annotations

import types

import numpy as np

from .. import images
from ..encode import MERGE, EncodedRecord, mrope_positions
from ..preprocess import preprocess

# the image case: text tokens before the image (the prompt's system prefix) and after it (state, schema,
# suffix), as a short request with one image is laid out
IMAGE_TEXT = (32, 224)


# a record's last tokens, where its questions lie: the tokens before them are its state
QUESTION_TOKENS = 120


def _questions(L):
    q = lambda qs, opts, t: types.SimpleNamespace(question_span=qs, option_spans=opts, type_index=t)  # noqa: E731
    b = max(0, L - QUESTION_TOKENS)
    return [q((b, b + 10), [(b + 10, b + 20), (b + 20, b + 30)], 0),
            q((b + 30, b + 40), [(b + 40 + 8 * i, b + 48 + 8 * i) for i in range(5)], 1),
            q((b + 80, b + 90), [(b + 90 + 6 * i, b + 96 + 6 * i) for i in range(4)], 2)]


def record(ids, **image_fields):
    """An EncodedRecord of the bench's making: random ids, the bench's questions, no tokenizer."""
    L = len(ids)
    return EncodedRecord(input_ids=ids, questions=tuple(_questions(L)), state_span=(0, 0),
                         state_tokens_before_truncation=0, state_truncated=False, **image_fields)


def image_record(data: bytes, vocab: int):
    """The record of a request with one image (file bytes ``data``) as the engine lays it out: IMAGE_TEXT random
    text ids before and after the image's pads, M-RoPE positions, the bench's questions at the end; without its
    pixels (end_to_end.forward_run makes them in each timed call)."""
    px = preprocess(images.decode(data, 0))
    (a, b), n = IMAGE_TEXT, px.num_tokens
    T = a + n + b
    spans = ((a, a + n, px.grid_thw[1] // MERGE, px.grid_thw[2] // MERGE),)
    return record(np.random.default_rng(1).integers(0, vocab, T), image_spans=spans,
                  positions=mrope_positions(T, spans)), px
