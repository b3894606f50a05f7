"""Validation: Cloudflare limits at ±1, reference-mode crash guards, and a hostile-body fuzz through the
whole parse → validate → encode path (every body must give a RequestError or a sound EncodedRecord)."""

from __future__ import annotations

import base64
import copy
import json
import pathlib
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clefcore.encode import EncodedRecord, Encoder
from clefcore.errors import BodyTooLargeError, RequestError
from clefcore.jsonvalue import MAX_DEPTH, MAX_ELEMENTS, parse_body
from clefcore.tokenize import Tokenizer
from clefcore.validate import validate_request

TOKENIZER = pathlib.Path(__file__).parent / "golden" / "model" / "tokenizer.json"
MODES = ("cloudflare", "reference")


@pytest.fixture(scope="module")
def encoder() -> Encoder:
    return Encoder(Tokenizer(TOKENIZER))


def valid_body() -> dict:
    return {
        "model": "clef-flash",
        "state": "Checkout fails for every customer.",
        "questions": {
            "urgent": {"type": "noul", "instructions": "Is it urgent?"},
            "team": {"type": "choice", "instructions": "Which team?",
                     "criteria": {"billing": "Payments", "technical": "Outages"}},
            "severity": {"type": "score", "instructions": "How severe?", "criteria": ["low", "high"]},
        },
    }


def rejected(body, mode="cloudflare") -> RequestError:
    with pytest.raises(RequestError) as info:
        validate_request(body, mode=mode)
    return info.value


def with_question(question: dict, qid: str = "q") -> dict:
    body = valid_body()
    body["questions"] = {qid: question}
    return body


def test_valid_body_passes_both_modes(encoder):
    for mode in MODES:
        request = validate_request(valid_body(), mode=mode)
        assert list(request) == ["model", "state", "questions"]
        assert list(request["questions"]) == ["urgent", "team", "severity"]
        assert isinstance(encoder.encode(request, 16384), EncodedRecord)


# --- Cloudflare limits at ±1 ----------------------------------------------------------------------

def counted(kind: str, n: int) -> dict:
    """A body of n questions, or of one question "c" with n choice options or n score levels."""
    if kind == "questions":
        return valid_body() | {"questions": {f"q{i}": {"type": "noul", "instructions": "Yes?"} for i in range(n)}}
    criteria = {f"o{i}": None for i in range(n)} if kind == "choice" else ["x"] * n
    return with_question({"type": kind, "instructions": "Pick", "criteria": criteria}, qid="c")


@pytest.mark.parametrize("kind, low, high, field, limit, needs", [
    ("questions", 1, 64, "questions", "1..64 questions", "questions: needs 1 to 64 questions"),
    ("choice", 2, 255, "questions.c.criteria", "2..255 options", "questions.c.criteria: choice needs 2 to 255 options"),
    ("score", 2, 10, "questions.c.criteria", "2..10 levels", "questions.c.criteria: score needs 2 to 10 levels"),
])
def test_count_limits(kind, low, high, field, limit, needs):
    for count in (low, high):
        request = validate_request(counted(kind, count))
        kept = request["questions"] if kind == "questions" else request["questions"]["c"]["criteria"]
        assert len(kept) == count
    for count in (low - 1, high + 1):
        error = rejected(counted(kind, count))
        assert (error.field, error.limit, error.message) == (field, limit, f"{needs}, got {count}")


@pytest.mark.parametrize("qid, ok", [
    ("a" * 100, True), ("a" * 101, False), ("A-z_0.9", True), ("", False), ("has space", False),
    ("colon:", False), ("ключ", False), ("a/b", False), ("<|im_end|>", False), ("x\n", False),
])
def test_question_ids(qid, ok):
    body = with_question({"type": "noul", "instructions": "Yes?"}, qid=qid)
    if ok:
        validate_request(body)
    else:
        error = rejected(body)
        assert error.limit == "[A-Za-z0-9_.-]{1,100}" and error.field.startswith("questions")
        assert f"got {len(qid)} characters" in error.message


@pytest.mark.parametrize("instructions", ["", [], {}, None, 0, False, 3.5])
def test_instructions_must_be_non_empty(instructions):
    error = rejected(with_question({"type": "noul", "instructions": instructions}))
    assert error.field == "questions.q.instructions" and error.limit == "non-empty"


def test_missing_instructions_and_accepted_forms():
    assert "missing" in rejected(with_question({"type": "noul"})).message
    for instructions in ("x", ["x"], {"ask": "x"}):
        validate_request(with_question({"type": "noul", "instructions": instructions}))
    for criteria in ({"true": "y"}, {"true": None, "false": "n"}, {}, None):   # noul's criteria
        validate_request(with_question({"type": "noul", "instructions": "x", "criteria": criteria}))


# --- images (issue 21): forms and byte limits here, pixels when the engine decodes (tests/test_images.py) ----

# Request 0 of shared/golden-images (png_data_url_noul) in its key order, with its image cut to the PNG
# signature and IHDR: validation checks the form and the size only, so it passes here and fails to decode later.
GOLDEN_IMAGES_0 = {
    "model": "clef-flash",
    "images": ["data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAEAAAAAw"],
    "state": "Screenshot attached: the checkout page shows a red error banner.",
    "questions": {"error_visible": {"type": "noul", "instructions": "Does the screenshot show an error?"}},
}
GOLDEN_IMAGES = pathlib.Path(__file__).parent / "golden_images" / "requests.jsonl"
PNG_URL = GOLDEN_IMAGES_0["images"][0]
PNG_BYTES = base64.b64decode(PNG_URL.split(",", 1)[1])
PNG_OBJECT = {"content_type": "image/png", "base64": PNG_URL.split(",", 1)[1]}


def with_images(images, body: dict | None = None) -> dict:
    body = copy.deepcopy(GOLDEN_IMAGES_0 if body is None else body)
    body["images"] = images
    return body


def without_images(body: dict) -> dict:
    return {key: value for key, value in body.items() if key != "images"}


@pytest.mark.parametrize("mode", MODES)
def test_images_are_carried_not_dropped(mode):
    # Reference mode used to drop `images` like any unknown field and answer from the text alone.
    request = validate_request(GOLDEN_IMAGES_0, mode=mode)
    assert request["images"] == [PNG_BYTES]
    assert without_images(request) == validate_request(without_images(GOLDEN_IMAGES_0), mode=mode)
    both = validate_request(with_images([PNG_URL, PNG_OBJECT, PNG_URL.replace("data:", "DATA:")]), mode=mode)
    assert both["images"] == [PNG_BYTES] * 3


# Refused in both modes, naming the item (the reference would open the path, fetch the URL, decode the bare
# base64 and crash on the object inside a list; clefcore/validate.py lists the deviations).
IMAGE_LISTS = [([PNG_URL] * 5, "images"), (["https://example.com/a.png"], "images[0]"),
               ([PNG_URL, "/etc/passwd"], "images[1]"), (["iVBORw0KGgo="], "images[0]"), ([""], "images[0]"),
               ([None], "images[0]"), ([[]], "images[0]"), ([{}], "images[0].content_type"),
               (["data:image/gif;base64,R0lGODdh"], "images[0]")]
# Not an array: Cloudflare's schema refuses the type; the reference would read a string as one image and
# crash on the rest: refused in both modes.
IMAGE_SCALARS = [PNG_URL, PNG_OBJECT, "", {}, 0, 1, False, True]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("images,field", IMAGE_LISTS, ids=range(len(IMAGE_LISTS)))
def test_bad_image_lists_are_refused(mode, images, field):
    error = rejected(with_images(images), mode)
    assert error.field == field and error.message.startswith(field)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("images", IMAGE_SCALARS, ids=range(len(IMAGE_SCALARS)))
def test_images_that_are_not_arrays(mode, images):
    error = rejected(with_images(images), mode)
    assert error.field == "images" and error.limit == "array of up to 4 images"
    assert error.message.startswith("images: must be an array of up to 4 images, got ")


@pytest.mark.parametrize("mode", MODES)
def test_empty_images_array_is_a_text_only_request(mode, encoder):
    # [] is a valid Cloudflare value (array, maxItems 4) holding no image: the text-only answer is exact.
    request = validate_request(with_images([]), mode=mode)
    assert request == validate_request(without_images(GOLDEN_IMAGES_0), mode=mode)
    assert "images" not in request
    assert isinstance(encoder.encode(request, 16384), EncodedRecord)


def test_null_images():
    # Reference: null carries no image (its processor runs only for requests with images). Cloudflare types
    # the field as an array, so null is refused there like any other type.
    assert validate_request(with_images(None), mode="reference") == validate_request(
        without_images(GOLDEN_IMAGES_0), mode="reference")
    error = rejected(with_images(None))
    assert error.field == "images" and error.message.endswith("got null")


def test_images_refusal_order():
    # Reference mode: the reference's own refusals come first, with its messages.
    body = {"model": "m", "images": ["https://x/a.png"], "state": "s", "questions": {}}
    assert rejected(body, "reference").message == "at least one question is required"
    # Cloudflare mode: the first violation in body order.
    body = with_images(["https://x/a.png"], {"model": "m", "temperature": 1, "state": "s", "questions": {}})
    assert rejected(body).field == "temperature"
    body = {"model": "m", "images": ["https://x/a.png"], "temperature": 1, "state": "s", "questions": {}}
    assert rejected(body).field == "images[0]"


@pytest.mark.parametrize("mode", MODES)
def test_every_golden_images_request_validates_with_its_images(mode):
    lines = GOLDEN_IMAGES.read_text().splitlines()
    assert len(lines) >= 9
    for line in lines:
        body = parse_body(line.encode())
        try:
            request = validate_request(body, mode)
        except RequestError as e:   # a question the reference takes and Cloudflare's limits do not
            assert mode == "cloudflare" and e.field.startswith("questions."), e.message
            request = validate_request(without_images(body) | {"images": body["images"]}, "reference")
        assert len(request["images"]) == len(body["images"]) >= 1


NOUL = {"type": "noul", "instructions": "x"}


@pytest.mark.parametrize("body, field, says", [
    (valid_body() | {"temperature": 1}, "temperature", "unknown field"),
    (valid_body() | {"videos": 1}, "videos", "unknown field"),
    (valid_body() | {"id": 1}, "id", "unknown field"),
    (with_question(NOUL | {"weight": 2}), "questions.q.weight", "unknown field"),
    ({"state": "x", "questions": {"q": NOUL}}, "model", "got missing"),
    ({"model": 1, "state": "x", "questions": {"q": NOUL}}, "model", "got number"),
    ({"model": "m", "questions": {"q": NOUL}}, "state", "required"),
    ({"model": "m", "state": None, "questions": {"q": NOUL}}, "state", "got null"),
    ({"model": "m", "state": 42, "questions": {"q": NOUL}}, "state", "got number"),
    ({"model": "m", "state": "x", "document": "y", "questions": {"q": NOUL}}, "document", "not both"),
    ({"model": "m", "state": "x"}, "questions", "got missing"),
    ({"model": "m", "state": "x", "questions": []}, "questions", "got array"),
    ({"model": "m", "state": "x", "questions": {"q": "noul"}}, "questions.q", "got string"),
    ({"model": "m", "state": "x", "questions": {"q": NOUL | {"type": "bool"}}}, "questions.q.type", 'got "bool"'),
    ({"model": "m", "state": "x", "questions": {"q": NOUL | {"type": ["noul"]}}}, "questions.q.type", "got array"),
    (with_question(NOUL | {"criteria": {"true": "y", "maybe": "m"}}), "questions.q.criteria.maybe", 'got "maybe"'),
    (with_question(NOUL | {"criteria": ["y", "n"]}), "questions.q.criteria", "got array"),
    (with_question(NOUL | {"criteria": "yes"}), "questions.q.criteria", "got string"),
    (with_question({"type": "choice", "instructions": "x"}), "questions.q.criteria", "got missing"),
    (with_question({"type": "choice", "instructions": "x", "criteria": ["a", "b"]}), "questions.q.criteria",
     "got array"),
    (with_question({"type": "choice", "instructions": "x", "criteria": {"": "empty", "b": "B"}}),
     "questions.q.criteria", "non-empty"),
    (with_question({"type": "score", "instructions": "x"}), "questions.q.criteria", "got missing"),
    (with_question({"type": "score", "instructions": "x", "criteria": {"0": "a", "1": "b"}}), "questions.q.criteria",
     "got object"),
    (with_question({"type": "score", "instructions": "x", "criteria": "ab"}), "questions.q.criteria", "got string"),
])
def test_cloudflare_refusals_name_the_field(body, field, says):
    error = rejected(body)
    assert error.field == field and says in error.message


def test_document_alias():
    body = valid_body()
    body["document"] = body.pop("state")
    for mode in MODES:
        assert validate_request(body, mode=mode)["state"] == "Checkout fails for every customer."


def test_first_violation_in_body_order():
    body = valid_body()
    body["questions"]["urgent"]["criteria"] = {"maybe": 1}
    body["questions"]["team"]["criteria"] = {"only": 1}
    assert rejected(body).field == "questions.urgent.criteria.maybe"


def test_body_not_object():
    for mode in MODES:
        for body in ([], "x", None, 3):
            assert "JSON object" in rejected(body, mode).message


# --- reference mode -------------------------------------------------------------------------------

@pytest.mark.parametrize("body, message", [
    ({"model": "m", "state": "x", "questions": {"a": {"type": "choice", "criteria": {}}, "b": {"type": "x"}}},
     "a: criteria must not be empty"),
    ({"model": "m", "state": "x", "questions": {"a": {"type": "noul"}, "b": {"type": "x"}}},
     "b: type must be noul, choice, or score"),
    ({"model": "m", "state": "x", "questions": {"a": {"type": {"x": 1}}}},
     "a: type must be noul, choice, or score"),
    ({"model": "m", "state": "x", "questions": {"a": {"type": "score", "criteria": []}}},
     "a: criteria must not be empty"),
    ({"model": None, "state": "x", "questions": {}}, "model and state are required"),
    ({"model": "m", "questions": {"a": {"type": "noul"}}}, "model and state are required"),
    ({"model": "m", "state": None, "questions": []}, "at least one question is required"),
])
def test_reference_messages(body, message):
    assert rejected(body, "reference").message == message


@pytest.mark.parametrize("question", [
    "noul", ["noul"], None,
    {"type": "noul", "criteria": ["tx"]},
    {"type": "noul", "criteria": "yes"},
    {"type": "choice", "criteria": ["a", "b"]},
    {"type": "choice", "criteria": "ab"},
    {"type": "score", "criteria": {"a": 1}},
    {"type": "score", "criteria": 3},
])
def test_reference_crash_cases_are_request_errors(question):
    error = rejected({"model": "m", "state": "x", "questions": {"q": question}}, "reference")
    assert error.field.startswith("questions.q")


def test_reference_empty_question_span_rejected():
    for instructions in (None, ""):
        body = {"model": "m", "state": "x", "questions": {"": {"type": "noul", "instructions": instructions}}}
        error = rejected(body, "reference")
        assert error.field == "questions..instructions" and "empty id" in error.message


def test_reference_is_lenient_where_the_reference_is(encoder):
    body = {"model": "", "state": None, "questions": {
        "": {"type": "noul", "instructions": 0, "criteria": []},
        "one": {"type": "choice", "criteria": {"only": None}},
        "lvl": {"type": "score", "criteria": [None]},
        "x y": {"type": "noul", "instructions": False, "criteria": {"true": None, "other": 1}},
    }}
    record = encoder.encode(validate_request(body, mode="reference"), 16384)
    assert [q.option_ids for q in record.questions] == [
        ("true", "false"), ("only",), ("0",), ("true", "false")]


# --- parse_body -----------------------------------------------------------------------------------

@pytest.mark.parametrize("data, needle", [
    (b'{"a": "\xff"}', "UTF-8"),
    (b'{"a": ', "line 1 column 7"),
    ('{"a": 1,\n "b": }', "line 2 column 7"),
    ("[" * 100000 + "]" * 100000, f"{MAX_DEPTH} levels"),
    ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), f"{MAX_DEPTH} levels"),
    ("9" * 5000, "digits"),
    ('{"state": {"k": ["\\ud800"]}}', "state.k[0]"),
    ('{"\\udfff": 1}', "surrogate"),
])
def test_parse_body_rejects(data, needle):
    with pytest.raises(RequestError) as info:
        parse_body(data)
    assert needle in info.value.message


@pytest.mark.parametrize("body", [
    "[" + "0," * MAX_ELEMENTS + "0]",                          # elements
    "[" + "[]," * (MAX_ELEMENTS // 2) + "[]]",                   # arrays, each counted
    "{" + ",".join(f'"{i}":{{}}' for i in range(MAX_ELEMENTS // 2 + 1)) + "}",   # members and objects
])
def test_parse_body_bounds_the_elements_before_parsing(body, monkeypatch):
    """More than MAX_ELEMENTS elements, members, arrays and objects: BodyTooLargeError naming the limit, before
    the parser builds anything."""
    def never(*args, **kwargs):
        raise AssertionError("parsed")
    monkeypatch.setattr("clefcore.jsonvalue.json.loads", never)
    with pytest.raises(BodyTooLargeError) as info:
        parse_body(body.encode())
    assert info.value.limit == f"{MAX_ELEMENTS} elements" and str(MAX_ELEMENTS) in info.value.message


def test_parse_body_counts_only_commas_and_brackets_outside_strings():
    """Commas and brackets inside strings (escaped quotes included) are text, not elements."""
    text = '\\"[{,' * MAX_ELEMENTS
    body = json.dumps({"state": text, "list": list(range(1000))})
    assert parse_body(body.encode())["state"] == text
    assert parse_body(body)["state"] == text


def test_parse_body_keeps_json_semantics():
    assert parse_body("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None
    value = parse_body(b'{"b": 1, "a": 2.0, "b": 3, "c": 1e5, "d": "\\ud83d\\ude80"}')
    assert list(value.items()) == [("b", 3), ("a", 2.0), ("c", 100000.0), ("d", "\U0001f680")]
    assert isinstance(value["b"], int) and isinstance(value["a"], float)


# --- fuzz -----------------------------------------------------------------------------------------

SPECIALS = ["<|im_end|>", "<|im_start|>", "<|endoftext|>", "<think>", "</think>", "<|image_pad|>",
            "<|vision_start|>"]
HOSTILE = [None, True, False, 0, -1, 1.5, 10 ** 40, float("inf"), float("nan"), "", " ", "\n", "x\u0304",
           "<|im_end|>", "a" * 20000, [], {}, [None], {"": ""}, {"true": None}, ["x"] * 11,
           {f"o{i}": i for i in range(256)}, [[[[[["deep"]]]]]], "\u2028\x00\x7f", -0.0]


def containers(value, path=()):
    """Every (path, container) inside a JSON value."""
    if isinstance(value, (dict, list)):
        yield path, value
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in items:
            yield from containers(child, path + (key,))


def with_specials(value, rng):
    """Plant special tokens in every string, keys included."""
    if isinstance(value, str):
        return rng.choice(SPECIALS) + value + rng.choice(SPECIALS)
    if isinstance(value, list):
        return [with_specials(v, rng) for v in value]
    if isinstance(value, dict):
        return {with_specials(k, rng): with_specials(v, rng) for k, v in value.items()}
    return value


def mutate(body: dict, rng: random.Random) -> dict:
    body = copy.deepcopy(body)
    for _ in range(rng.randint(1, 3)):
        path, target = rng.choice(list(containers(body)))
        action = rng.random()
        if isinstance(target, dict) and target and action < 0.3:
            del target[rng.choice(list(target))]
        elif isinstance(target, dict) and action < 0.5:
            key = rng.choice(["images", "videos", "extra", "type", "criteria", "instructions", "", "true"])
            target[key] = copy.deepcopy(rng.choice(HOSTILE))
        elif isinstance(target, dict) and target:
            target[rng.choice(list(target))] = copy.deepcopy(rng.choice(HOSTILE))
        elif isinstance(target, list) and target and action < 0.7:
            target[rng.randrange(len(target))] = copy.deepcopy(rng.choice(HOSTILE))
        elif isinstance(target, list):
            target.append(copy.deepcopy(rng.choice(HOSTILE)))
    if rng.random() < 0.2:
        body = with_specials(body, rng)
    return body


def limit_bodies() -> list[dict]:
    bodies = []
    for n in (0, 1, 2, 64, 65):
        body = valid_body()
        body["questions"] = {f"q{i}": {"type": "noul", "instructions": "?"} for i in range(n)}
        bodies.append(body)
    for n in (0, 1, 2, 255, 256):
        criteria = {str(i): i for i in range(n)}
        bodies.append(with_question({"type": "choice", "instructions": "?", "criteria": criteria}))
    for n in (0, 1, 2, 10, 11):
        bodies.append(with_question({"type": "score", "instructions": "?", "criteria": list(range(n))}))
    for qid in ("a" * 100, "a" * 101, "", " ", "<|im_end|>"):
        bodies.append(with_question({"type": "noul"}, qid=qid))
    return bodies


def raw_bodies(rng: random.Random) -> list[bytes | str]:
    text = json.dumps(valid_body())
    out = [
        b"", b"null", b"[]", b"{}", b"\xff\xfe", b"\xef\xbb\xbf" + text.encode(), b"\xc3(" + text.encode(),
        text[:-1], text + "x", '{"model": "m", "state": 1e400, "questions": {}}',
        '{"model": "m", "state": NaN, "questions": {"q": {"type": "noul", "instructions": -Infinity}}}',
        '{"model": "m", "state": ' + "9" * 4301 + ', "questions": {}}',
        '{"model": "m", "state": "\\ud800", "questions": {}}',
        '{"model": "m", "state": "x", "questions": {"\\udc00": {"type": "noul"}}}',
        '{"model": "m", "state": ' + "[" * 5000 + "]" * 5000 + ', "questions": {}}',
        '{"model": "m", "state": ' + "{\"a\":" * (MAX_DEPTH - 1) + "1" + "}" * (MAX_DEPTH - 1) + "}",
        '{"model": "m", "state": "' + "\u00e9" * 50000
        + '", "questions": {"q": {"type": "noul", "instructions": "x"}}}',
    ]
    for _ in range(60):  # byte-level damage to a valid body
        data = bytearray(text.encode())
        position = rng.randrange(len(data))
        choice = rng.random()
        if choice < 0.4:
            data[position] = rng.randrange(256)
        elif choice < 0.7:
            del data[position:position + rng.randint(1, 8)]
        else:
            data[position:position] = rng.choice([b"\x80", b"\\ud800", b"\xed\xa0\x80", b"[", b"}", b"1e999"])
        out.append(bytes(data))
    return out


def bodies() -> list:
    rng = random.Random(1729)
    generated = [mutate(valid_body(), rng) for _ in range(400)]
    serialised = [json.dumps(b, ensure_ascii=rng.random() < 0.5) for b in generated + limit_bodies()]
    return serialised + raw_bodies(rng)


def check_record(record: EncodedRecord, max_length: int):
    ids = record.input_ids
    assert isinstance(ids, np.ndarray) and ids.dtype == np.int32 and 0 < len(ids) <= max_length
    start, end = record.state_span
    assert 0 <= start <= end <= len(ids)
    assert record.state_truncated == (end - start < record.state_tokens_before_truncation)
    for q in record.questions:
        assert end <= q.question_span[0] < q.question_span[1] <= len(ids)  # never empty: no NaN logits
        assert len(q.option_ids) == len(q.option_spans) >= 1
        assert all(q.question_span[1] < s < e <= len(ids) for s, e in q.option_spans)


def run_pipeline(data, encoder: Encoder, max_length: int) -> int:
    """parse → validate (both modes) → encode; returns how many records came out."""
    try:
        body = parse_body(data)
    except RequestError:
        return 0
    made = 0
    for mode in MODES:
        try:
            record = encoder.encode(validate_request(body, mode=mode), max_length)
        except RequestError as error:
            assert error.message and isinstance(error.field, str)
            json.dumps(error.to_json()).encode("utf-8")  # the error itself must be sendable
            continue
        check_record(record, max_length)
        made += 1
    return made


def test_fuzz_bodies(encoder):
    cases = bodies()
    assert len(cases) >= 300
    rng = random.Random(7)
    made = sum(run_pipeline(data, encoder, rng.choice([16384, 16384, 300, 120])) for data in cases)
    assert made > 0  # the generator must also reach the encoder, not only error paths


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
    | st.sampled_from(SPECIALS + ["noul", "choice", "score", "true", "false"]),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.sampled_from(["type", "instructions", "criteria", "true", "false", "q", "", "model", "state"])
        | st.text(max_size=5), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(model=json_values, state=json_values, questions=json_values, extra=st.booleans())
def test_fuzz_hypothesis(encoder, model, state, questions, extra):
    body = {"model": model, "state": state, "questions": questions}
    if extra:
        body["document"] = state
    run_pipeline(json.dumps(body), encoder, 16384)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(questions=st.dictionaries(st.text(max_size=6), st.fixed_dictionaries(
    {"type": st.sampled_from(["noul", "choice", "score"])},
    optional={"instructions": json_values, "criteria": json_values}), max_size=4))
def test_fuzz_hypothesis_questions(encoder, questions):
    run_pipeline(json.dumps({"model": "m", "state": "s", "questions": questions}), encoder, 16384)


def test_fuzz_bodies_through_the_engine():
    """The whole engine (tiny golden model): a typed RequestError or a complete answer, never anything else."""
    import clefcore
    engines = [clefcore.load(TOKENIZER.parent, validation=mode, context_length=600) for mode in MODES]
    answered = 0
    for data in bodies():
        for engine in engines:
            try:
                out = engine.decide(parse_body(data))
            except RequestError as error:
                json.dumps(error.to_json(), allow_nan=False).encode("utf-8")
                continue
            text = json.dumps(out, allow_nan=False, ensure_ascii=False).encode("utf-8")  # sendable as is
            assert list(out["answers"]) == list(parse_body(data)["questions"]) and text
            answered += 1
    assert answered >= 50


@pytest.mark.parametrize("videos", [["data:video/mp4;base64,AAAA"], [["https://example.com/f1.jpg"]], "clip.mp4",
                                    {"url": "x"}, 0, ""])
def test_reference_mode_refuses_videos_instead_of_ignoring_them(videos):
    """The reference hands `videos` to its processor; answering without them would be a silent wrong answer."""
    body = {"model": "clef-flash", "state": "s", "questions": {"q": {"type": "noul"}}, "videos": videos}
    with pytest.raises(RequestError, match="videos: videos are not supported") as e:
        validate_request(body, "reference")
    assert e.value.field == "videos"


@pytest.mark.parametrize("videos", [None, []])
def test_reference_mode_takes_no_videos_as_text_only(videos):
    body = {"model": "clef-flash", "state": "s", "questions": {"q": {"type": "noul"}}, "videos": videos}
    assert validate_request(body, "reference")["state"] == "s"
