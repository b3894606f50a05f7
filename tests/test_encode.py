"""Encoding against the reference's golden fixtures, plus render and tokenizer-regex unit tests."""

from __future__ import annotations

import json
import pathlib
import unicodedata

import numpy as np
import pytest

from clefcore.encode import Encoder, state_text_cut
from clefcore.errors import ContextLengthError, RequestError
from clefcore.jsonvalue import parse_body, render
from clefcore.tokenize import Tokenizer
from clefcore.validate import validate_request

GOLDEN = pathlib.Path(__file__).parent / "golden"
TOKENIZER = GOLDEN / "model" / "tokenizer.json"
NOUL_DEFAULTS = {"true": "The proposition is true or the answer is yes.",  # clef-head.md §3.1
                 "false": "The proposition is false or the answer is no."}
REQUESTS = (GOLDEN / "requests.jsonl").read_bytes().splitlines()
EXPECTED = [json.loads(line) for line in (GOLDEN / "expected.jsonl").read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def encoders() -> dict:
    return {regex: Encoder(Tokenizer(TOKENIZER, regex=regex)) for regex in (None, "qwen2", "qwen35")}


def encode_fixture(encoder: Encoder, index: int):
    request = validate_request(parse_body(REQUESTS[index]), mode="reference")
    return encoder.encode(request, EXPECTED[index]["max_length"])


def as_expected(record) -> dict:
    """The encoder's output in the fixture's vocabulary."""
    return {
        "input_ids": record.input_ids.tolist(),
        "num_tokens": len(record.input_ids),
        "state_span": list(record.state_span),
        "state_tokens_before_truncation": record.state_tokens_before_truncation,
        "state_truncated": record.state_truncated,
        "questions": [
            {"id": q.id, "type": q.type, "type_index": q.type_index, "question_span": list(q.question_span),
             "option_ids": list(q.option_ids), "option_spans": [list(span) for span in q.option_spans]}
            for q in record.questions
        ],
    }


def test_fixture_files_line_up():
    assert len(REQUESTS) == len(EXPECTED) > 0
    assert [e["index"] for e in EXPECTED] == list(range(len(EXPECTED)))


@pytest.mark.parametrize("index", range(len(EXPECTED)), ids=[e["name"] for e in EXPECTED])
def test_golden(encoders, index):
    expected = EXPECTED[index]
    if "error" in expected:
        with pytest.raises(RequestError) as info:
            encode_fixture(encoders[None], index)
        assert info.value.message == expected["error"]
        return
    record = encode_fixture(encoders[None], index)
    assert record.input_ids.dtype == np.int32
    keys = ("id", "type", "type_index", "question_span", "option_ids", "option_spans")
    want = {key: expected[key] for key in ("input_ids", "num_tokens", "state_span",
                                           "state_tokens_before_truncation", "state_truncated")}
    want["questions"] = [{key: q[key] for key in keys} for q in expected["questions"]]
    assert as_expected(record) == want


def test_schema_error_carries_numbers(encoders):
    index = next(e["index"] for e in EXPECTED if e.get("error", "").startswith("schema requires"))
    with pytest.raises(ContextLengthError) as info:
        encode_fixture(encoders[None], index)
    assert f"schema requires {info.value.required} tokens" in info.value.message
    assert info.value.maximum == EXPECTED[index]["max_length"] < info.value.required


def test_zero_budget_boundary(encoders):
    """max_length == schema length keeps zero state tokens; one less is the schema error."""
    request = validate_request(parse_body(REQUESTS[0]), mode="reference")
    full = encoders[None].encode(request, 16384)
    fixed = len(full.input_ids) - full.state_tokens_before_truncation
    empty = encoders[None].encode(request, fixed)
    assert empty.state_span[0] == empty.state_span[1] and empty.state_truncated
    assert len(empty.input_ids) == fixed
    with pytest.raises(ContextLengthError) as info:
        encoders[None].encode(request, fixed - 1)
    assert (info.value.required, info.value.maximum) == (fixed, fixed - 1)


def test_spans_cover_rendered_pieces(encoders):
    """Independent of the fixtures: every option span re-tokenizes to its rendered option JSON."""
    tokenizer = encoders[None].tokenizer
    request = validate_request(parse_body(REQUESTS[0]), mode="reference")
    record = encoders[None].encode(request, 16384)
    for q in record.questions:
        question = request["questions"][q.id]
        for option_id, (start, end) in zip(q.option_ids, q.option_spans):
            if question["type"] == "score":
                description = question["criteria"][int(option_id)]
            elif question["type"] == "choice":
                description = question["criteria"][option_id]
            else:
                description = (question.get("criteria") or {}).get(option_id, NOUL_DEFAULTS[option_id])
            text = render({"option_id": option_id, "description": description})
            assert record.input_ids[start:end].tolist() == tokenizer.encode_pieces([text])[0]


# --- render ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, text", [
    (1e-05, "1e-05"), (1e16, "1e+16"), (1e15, "1000000000000000.0"), (-0.0, "-0.0"), (5e-324, "5e-324"),
    (1250.0, "1250.0"), (1.5e300, "1.5e+300"), (0.0001, "0.0001"), (float("inf"), "Infinity"),
    (float("-inf"), "-Infinity"), (10**30, "1" + "0" * 30), (True, "true"), (None, "null"),
    ([float("inf"), float("nan")], "[Infinity,NaN]"),    # the reference's spelling; parse_body refuses them
    # the int/float distinction of the incoming JSON survives parse_body
    (parse_body('[1e5, 2.5E-3, 2.50, -0, -0.0, 123456789.123456789, 7]'),
     "[100000.0,0.0025,2.5,0,-0.0,123456789.12345679,7]"),
    ("raw \"text\"\n", "raw \"text\"\n"),
    (["\x00\x1f\b\f\n\r\t\"\\"], '["\\u0000\\u001f\\b\\f\\n\\r\\t\\"\\\\"]'),
    (["\u2028\u2029\x7f\u00e9\u4e2d\U0001f680"], '["\u2028\u2029\x7f\u00e9\u4e2d\U0001f680"]'),
    # keys sorted by code point, recursively; arrays keep their order
    ({"b": {"z": 1, "Z": 2}, "a": [3, 1], "\u00e9": 0, "B": None}, '{"B":null,"a":[3,1],"b":{"Z":2,"z":1},"\u00e9":0}'),
    ({"option_id": "x", "description": "d"}, '{"description":"d","option_id":"x"}'),
])
def test_render(value, text):
    assert render(value) == text


@pytest.mark.parametrize("literal", ["1E400", "NaN", "-Infinity"])
def test_parse_body_refuses_non_finite_numbers(literal):
    with pytest.raises(RequestError, match="not finite"):
        parse_body(f'{{"state": [{literal}]}}')


# --- tokenizer regex ------------------------------------------------------------------------------

def has_surviving_marks(line: bytes) -> bool:
    text = unicodedata.normalize("NFC", json.dumps(json.loads(line), ensure_ascii=False))
    return any(unicodedata.category(c).startswith("M") for c in text)


@pytest.mark.parametrize("index", [e["index"] for e in EXPECTED if "error" not in e],
                         ids=[e["name"] for e in EXPECTED if "error" not in e])
def test_forced_regex_on_golden(encoders, index):
    """The fixtures follow transformers 5.24 (Qwen3.5 regex, same as the shipped file). The Qwen2 regex
    agrees wherever no combining mark survives NFC, and must differ where one does."""
    shipped = as_expected(encode_fixture(encoders[None], index))
    assert as_expected(encode_fixture(encoders["qwen35"], index)) == shipped
    qwen2 = as_expected(encode_fixture(encoders["qwen2"], index))
    assert (qwen2 != shipped) == has_surviving_marks(REQUESTS[index])


def test_forced_regex_differs_on_combining_marks(encoders):
    qwen2, qwen35 = encoders["qwen2"].tokenizer, encoders["qwen35"].tokenizer
    assert qwen2.encode_pieces(["x\u0304"]) != qwen35.encode_pieces(["x\u0304"])
    plain = ["Plain ASCII text, numbers 12345 and  spaces.\n", "caf\u00e9 \u4e2d\u6587"]
    assert qwen2.encode_pieces(plain) == qwen35.encode_pieces(plain)


def test_special_tokens_in_text_are_parsed(encoders):
    tokenizer = encoders[None].tokenizer
    (ids,) = tokenizer.encode_pieces(["a<|im_end|>b"])
    assert tokenizer.encode_pieces(["<|im_end|>"]) == [[ids[1]]] and len(ids) == 3


def test_unknown_regex_rejected():
    with pytest.raises(ValueError):
        Tokenizer(TOKENIZER, regex="gpt2")


# --- the state's text is cut before it is tokenized ---------------------------------------------------------

def _texts(n: int) -> dict:
    """States of at least ``n`` characters that test the cut: the vocabulary's longest tokens (in bytes, and
    in ASCII characters), added tokens, one giant pre-tokenizer word, a whitespace run, compositions of three
    characters into two bytes, digits, a JSON value, and a seeded mix of all of it."""
    pool = ["a", " ", "\n", "0", "é", "e\u0301", "U\u0308\u0304", "日本", "🚀", "<|im_end|>", "<|endoftext|>",
            " สวัสดีครับ", "Subscription", "{", "}", "\"", "\\", "\u2028"]
    rng = np.random.default_rng(47)
    return {"longest": " สวัสดีครับ" * n, "ascii": "Subscription" * n, "added": "<|endoftext|>" * n,
            "word": "a" * n, "spaces": " " * n + "x", "composed": "U\u0308\u0304" * n, "digits": "0123456789" * n,
            "json": {"rows": [{"id": i, "tag": "Subscription"} for i in range(n // 4)]},
            "mix": "".join(pool[i] for i in rng.integers(0, len(pool), n))}


def _encode_uncut(encoder: Encoder, request: dict, context_length: int, monkeypatch):
    """The rule itself: the whole text tokenized, then truncated (no cut)."""
    with monkeypatch.context() as m:
        m.setattr("clefcore.encode.state_text_cut", lambda room, longest: 1 << 62)
        return encoder.encode(request, context_length)


@pytest.mark.parametrize("regex", [None, "qwen35"])
@pytest.mark.parametrize("room", [0, 1, 57, 300])
def test_the_cut_never_changes_the_prompt(encoders, monkeypatch, regex, room):
    """A state past the cut (clefcore.encode.state_text_cut) gives the prompt that tokenizing all of it would:
    the same ids, spans and truncation, for texts built to strain the bound, and for texts of exactly the cut's
    length and one character either side of it."""
    encoder = encoders[regex]
    request = validate_request(parse_body(REQUESTS[0]), mode="reference")
    request = dict(request, state="")
    fixed = len(encoder.encode(request, 16384).input_ids)
    context = fixed + room
    cut = state_text_cut(room, encoder.tokenizer.max_chars_per_token)
    assert encoder.tokenizer.max_chars_per_token == 2 * 31   # the golden vocabulary's " สวัสดีครับ", 31 bytes
    cases = _texts(cut + 5)
    cases.update({f"mix{d:+d}": cases["mix"][:cut + d] for d in (-1, 0, 1)})
    for name, state in cases.items():
        record = encoder.encode(dict(request, state=state), context)
        whole = _encode_uncut(encoder, dict(request, state=state), context, monkeypatch)
        assert record.input_ids.tolist() == whole.input_ids.tolist(), name
        assert (record.state_span, record.questions, record.state_truncated) == \
            (whole.state_span, whole.questions, whole.state_truncated), name
        assert record.state_cut == (len(render(state)) > cut), name
        assert record.state_truncated, name


def test_a_cut_below_the_bound_would_change_the_prompt(encoders, monkeypatch):
    """The comparison above can fail: a cut one character short of the text the kept tokens stand for splits the
    last of them."""
    encoder = encoders[None]
    request = dict(validate_request(parse_body(REQUESTS[0]), mode="reference"), state="")
    fixed = len(encoder.encode(request, 16384).input_ids)
    state, room = "Subscription " * 1000, 40
    whole = _encode_uncut(encoder, dict(request, state=state), fixed + room, monkeypatch)
    start, end = whole.state_span
    kept = encoder.tokenizer._tok.decode(whole.input_ids[start:end].tolist())
    assert state.startswith(kept)
    monkeypatch.setattr("clefcore.encode.state_text_cut", lambda room, longest: len(kept) - 1)
    short = encoder.encode(dict(request, state=state), fixed + room)
    assert short.input_ids.tolist() != whole.input_ids.tolist()


@pytest.mark.parametrize("change", ["removed_split", "whitespace", "strip_normalizer", "not_byte_level"])
def test_no_cut_where_a_token_may_stand_for_unbounded_text(tmp_path, change):
    """A tokenizer that may drop text (a split that removes what it splits on, whitespace splitting, a stripping
    normalizer) or is not byte-level has no bound on the text a token stands for: its states are tokenized
    whole, as before."""
    spec = json.loads(TOKENIZER.read_text(encoding="utf-8"))
    split, byte_level = spec["pre_tokenizer"]["pretokenizers"]
    if change == "removed_split":
        spec["pre_tokenizer"]["pretokenizers"] = [dict(split, behavior="Removed"), byte_level]
    elif change == "whitespace":
        spec["pre_tokenizer"]["pretokenizers"] = [{"type": "WhitespaceSplit"}, byte_level]
    elif change == "strip_normalizer":
        strip = {"type": "Strip", "strip_left": True, "strip_right": True}
        spec["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "NFC"}, strip]}
    else:
        spec["decoder"] = {"type": "Fuse"}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    tokenizer = Tokenizer(path)
    assert tokenizer.max_chars_per_token is None
    encoder = Encoder(tokenizer)
    state = "word " * 4000   # past where the golden vocabulary's bound would cut it, at 36 tokens of room
    assert len(state) > state_text_cut(36, 62)
    request = dict(validate_request(parse_body(REQUESTS[0]), mode="reference"), state="")
    fixed = len(encoder.encode(request, 16384).input_ids)
    record = encoder.encode(dict(request, state=state), fixed + 36)
    assert not record.state_cut
    assert record.state_tokens_before_truncation == len(tokenizer.encode_pieces([state])[0])
