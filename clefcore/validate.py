"""System One request validation.

``mode="reference"`` accepts exactly what Cloudflare's reference ``systemone`` accepts, with its messages
(clef-head.md §2); where the reference would crash or return NaN logits it gets a clear ``RequestError``.
``mode="cloudflare"`` adds the hosted Workers AI limits (systemone-protocol.md §3, §9, §14) and reports
the first violation in body order.

Images (protocol §3.7): both modes take an array of up to 4 items, each a data URL or a
``{content_type, base64}`` object, within the byte limits (clefcore/images.py; pixels are checked when the
engine decodes them); the normalised request then carries ``images`` (each image's file bytes). ``images``
that carry no image, ``[]`` in both modes and ``null`` in reference mode, leave a text-only request.

Reference mode deviates from the reference's processor only where following it would be unsafe or wrong
(clef-images.md §1): it never opens a path, fetches a URL or decodes bare base64 (each refused by item);
it accepts ``DATA:`` in any case and the object form (the reference decodes the first to garbage and crashes
on the second with a TypeError); it applies Cloudflare's count, size and pixel limits (the reference has none);
and it refuses a lone string or object instead of reading it as one image.
"""

from __future__ import annotations

import json
import re
from typing import Any

from clefcore.errors import RequestError
from clefcore.images import parse_images
from clefcore.jsonvalue import join_path

QUESTION_TYPES = ("noul", "choice", "score")
TOP_LEVEL_FIELDS = ("model", "state", "document", "questions")
QUESTION_FIELDS = ("type", "instructions", "criteria")
MAX_QUESTIONS = 64
CHOICE_OPTIONS = (2, 255)
SCORE_LEVELS = (2, 10)
QUESTION_ID = re.compile(r"[A-Za-z0-9_.-]{1,100}")


def validate_request(body: Any, mode: str = "cloudflare") -> dict:
    """Check a parsed body; return ``{"model", "state", "questions"}`` (questions in request order)."""
    if mode not in ("reference", "cloudflare"):
        raise ValueError(f"unknown validation mode {mode!r}")
    if not isinstance(body, dict):
        raise RequestError(f"request body must be a JSON object, got {_kind(body)}")
    if mode == "reference":
        return _reference(body)
    return _cloudflare(body)


def _kind(value: Any) -> str:
    # JSON names, so messages speak the client's language (bool before int: bool is an int subclass).
    for cls, name in ((str, "string"), (bool, "boolean"), (int, "number"), (float, "number"),
                      (dict, "object"), (list, "array")):
        if isinstance(value, cls):
            return name
    return "null" if value is None else type(value).__name__


def _show(text: str, limit: int = 40) -> str:
    """A quoted, escaped, shortened id for messages (ids are client-controlled and unbounded)."""
    shown = json.dumps(text[:limit])
    return shown if len(text) <= limit else shown[:-1] + '..."'


def _got(container: dict, key: str) -> str:
    return "missing" if key not in container else _kind(container[key])


def _state_key(body: dict) -> str | None:
    # `document` is the TypeSafe draft's name for `state` (protocol §3.1); it counts only without `state`.
    return "state" if "state" in body else "document" if "document" in body else None


def _check_images(body: dict, mode: str) -> list[bytes]:
    """The images of the request (file bytes, request order); [] when it carries none."""
    if "images" not in body:
        return []
    images = body["images"]
    # An empty array is a valid Cloudflare value (array, maxItems 4) with no image in it: the text-only answer is
    # exact. The reference calls its processor only when the request has images (clef-head.md §3.8), and null
    # (JSON's "unset") has none. Cloudflare's schema types the field as an array only.
    if (isinstance(images, list) and not images) or (images is None and mode == "reference"):
        return []
    if not isinstance(images, list):
        # in reference mode too: the reference would read a string as one image and crash on an object
        raise RequestError(f"images: must be an array of up to 4 images, got {_kind(images)}", field="images",
                           limit="array of up to 4 images")
    return parse_images(images)


def _normalised(body: dict, state_key: str, images: list[bytes]) -> dict:
    out = {"model": body["model"], "state": body[state_key], "questions": body["questions"]}
    if images:
        out["images"] = images
    return out


# --- reference -------------------------------------------------------------------------------------

def _reference(body: dict) -> dict:
    state_key = _state_key(body)
    if not isinstance(body.get("model"), str) or state_key is None:
        raise RequestError("model and state are required", field="model" if state_key else "state")
    questions = body.get("questions")
    if not isinstance(questions, dict) or not questions:
        raise RequestError("at least one question is required", field="questions",
                           limit="at least 1 question")
    for qid, question in questions.items():
        path = join_path("questions", qid)
        if not isinstance(question, dict):  # the reference raises AttributeError on question.get
            raise RequestError(f"{qid}: question must be an object, got {_kind(question)}", field=path)
        qtype = question.get("type")
        if qtype not in QUESTION_TYPES:  # a tuple, so unhashable types compare (a TypeError there)
            raise RequestError(f"{qid}: type must be noul, choice, or score", field=path + ".type",
                               limit="noul, choice, or score")
        criteria = question.get("criteria")
        if qtype != "noul" and not criteria:
            raise RequestError(f"{qid}: criteria must not be empty", field=path + ".criteria")
        # The reference iterates choice criteria with .items() and score criteria with enumerate(), and
        # dict.update()s truthy noul criteria; anything else crashes or means nothing there.
        wanted = {"noul": dict, "choice": dict, "score": list}[qtype]
        if criteria and not isinstance(criteria, wanted):
            shape = "an object" if wanted is dict else "an array"
            raise RequestError(f"{qid}: {qtype} criteria must be {shape}, got {_kind(criteria)}",
                               field=path + ".criteria")
        # An empty question span averages nothing: the reference returns NaN logits.
        if qid == "" and question.get("instructions") in (None, ""):
            raise RequestError("question with an empty id needs non-empty instructions",
                               field=path + ".instructions")
    # Last, so bodies the reference itself refuses keep its messages. Unknown fields are ignored here, as
    # the reference does, but `images` and `videos` must not be: it would answer without them. (Cloudflare's
    # schema has no `videos`: the cloudflare mode refuses it as an unknown field.)
    images = _check_images(body, "reference")
    if body.get("videos") not in (None, []):
        raise RequestError("videos: videos are not supported", field="videos")
    return _normalised(body, state_key, images)


# --- cloudflare ------------------------------------------------------------------------------------

def _cloudflare(body: dict) -> dict:
    images = []
    for key in body:
        if key == "images":
            images = _check_images(body, "cloudflare")
            continue
        if key not in TOP_LEVEL_FIELDS:
            raise RequestError(f"{_show(key)}: unknown field (allowed: {', '.join(TOP_LEVEL_FIELDS)})",
                               field=join_path("", key))
    if not isinstance(body.get("model"), str):
        raise RequestError(f"model: required string, got {_got(body, 'model')}", field="model")
    if "state" in body and "document" in body:
        raise RequestError("document: give state or document, not both", field="document")
    state_key = _state_key(body)
    if state_key is None:
        raise RequestError("state: required", field="state")
    if not isinstance(body[state_key], (str, dict, list)):
        raise RequestError(f"{state_key}: must be a string, object or array, got {_kind(body[state_key])}",
                           field=state_key, limit="string, object or array")
    questions = body.get("questions")
    if not isinstance(questions, dict):
        raise RequestError(f"questions: required object, got {_got(body, 'questions')}", field="questions")
    if not 1 <= len(questions) <= MAX_QUESTIONS:
        raise RequestError(f"questions: needs 1 to {MAX_QUESTIONS} questions, got {len(questions)}",
                           field="questions", limit=f"1..{MAX_QUESTIONS} questions")
    for qid, question in questions.items():
        _cloudflare_question(qid, question)
    return _normalised(body, state_key, images)


def _cloudflare_question(qid: str, question: Any) -> None:
    path = join_path("questions", qid)
    if not QUESTION_ID.fullmatch(qid):
        raise RequestError(f"questions: id {_show(qid)} must be 1 to 100 characters of A-Z a-z 0-9 _ . - "
                           f"(got {len(qid)} characters)", field=path, limit="[A-Za-z0-9_.-]{1,100}")
    if not isinstance(question, dict):
        raise RequestError(f"{path}: must be an object, got {_kind(question)}", field=path)
    for key in question:
        if key not in QUESTION_FIELDS:
            field = join_path(path, key)
            raise RequestError(f"{field}: unknown field (allowed: {', '.join(QUESTION_FIELDS)})", field=field)
    qtype = question.get("type")
    if qtype not in QUESTION_TYPES:
        raise RequestError(f"{path}.type: must be noul, choice, or score, got "
                           f"{_show(qtype) if isinstance(qtype, str) else _kind(qtype)}",
                           field=path + ".type", limit="noul, choice, or score")
    instructions = question.get("instructions")
    if not isinstance(instructions, (str, dict, list)) or not instructions:
        got = _got(question, "instructions")
        if isinstance(instructions, (str, dict, list)):
            got = "empty " + got
        raise RequestError(f"{path}.instructions: required non-empty string, object or array, got {got}",
                           field=path + ".instructions", limit="non-empty")
    criteria = question.get("criteria")
    cpath = path + ".criteria"
    if qtype == "noul":
        if criteria is None:
            return
        if not isinstance(criteria, dict):
            raise RequestError(f"{cpath}: noul criteria must be an object, got {_kind(criteria)}",
                               field=cpath)
        for key in criteria:
            if key not in ("true", "false"):
                raise RequestError(f"{cpath}: noul criteria keys must be true or false, got {_show(key)}",
                                   field=join_path(cpath, key), limit="true, false")
    elif qtype == "choice":
        _check_criteria(question, cpath, dict, "choice", "an object of options", CHOICE_OPTIONS, "options")
        if "" in criteria:
            raise RequestError(f"{cpath}: option ids must be non-empty strings", field=cpath,
                               limit="non-empty")
    else:
        _check_criteria(question, cpath, list, "score", "an array of levels", SCORE_LEVELS, "levels")


def _check_criteria(question: dict, cpath: str, kind: type, qtype: str, shape: str, bounds, unit: str) -> None:
    """choice/score criteria: the right JSON type, and a count within the Cloudflare bounds."""
    criteria = question.get("criteria")
    if not isinstance(criteria, kind):
        raise RequestError(f"{cpath}: {qtype} criteria must be {shape}, got {_got(question, 'criteria')}",
                           field=cpath)
    low, high = bounds
    if not low <= len(criteria) <= high:
        raise RequestError(f"{cpath}: {qtype} needs {low} to {high} {unit}, got {len(criteria)}",
                           field=cpath, limit=f"{low}..{high} {unit}")
