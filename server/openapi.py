"""The OpenAPI 3.1 description served at ``/openapi.json``.

Built from the running configuration, so the limits it states are the ones this server enforces
(Cloudflare's with ``--validation cloudflare``, the reference's looser ones otherwise). The request schema
mirrors systemone-protocol.md §3 and the response schema its §5, including the exact answer field sets
that strict clients check (§11).
"""

from __future__ import annotations

from clefcore import __version__, images as _images
from clefcore.options import ServiceConfig
from clefcore.preparer import NO_IMAGES
from clefcore.example_request import support_ticket

# Descriptions (choice options, score levels, noul criteria values) may be any JSON value: they are
# rendered into the prompt as they are. The schema states exactly what the validator accepts, so that
# schema-driven fuzzers find every disagreement in either direction.
_ANY: dict = {}
_STATE = {"type": ["string", "object", "array"]}


def _question_schema(cloudflare: bool) -> dict:
    if cloudflare:
        instructions = {"anyOf": [{"type": "string", "minLength": 1}, {"type": "object", "minProperties": 1},
                                  {"type": "array", "minItems": 1}]}
        choice = {"type": "object", "minProperties": 2, "maxProperties": 255,
                  "propertyNames": {"minLength": 1}, "additionalProperties": _ANY}
        score = {"type": "array", "minItems": 2, "maxItems": 10, "items": _ANY}
        noul = {"type": ["object", "null"], "additionalProperties": False,
                "properties": {"true": _ANY, "false": _ANY}}
    else:  # the reference's rules: instructions optional (the id stands in), one option or level is enough
        instructions = _ANY
        choice = {"type": "object", "minProperties": 1, "additionalProperties": _ANY}
        score = {"type": "array", "minItems": 1, "items": _ANY}
        noul = _ANY

    def question(kind: str, criteria: dict, required_criteria: bool) -> dict:
        required = ["type"] + (["instructions"] if cloudflare else [])
        required += ["criteria"] if required_criteria else []
        return {"type": "object", "required": required, "additionalProperties": not cloudflare,
                "properties": {"type": {"const": kind}, "instructions": instructions, "criteria": criteria}}

    return {"oneOf": [question("noul", noul, False), question("choice", choice, True),
                      question("score", score, True)]}


# --- images (protocol §3.7): the rules are clefcore/images.py's, the limits its constants ----------------

# Standard base64, padded, no whitespace, at least one byte (as images.py reads it; an empty one is refused).
_B64 = r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{4}|[A-Za-z0-9+/]{3}=|[A-Za-z0-9+/]{2}==)"
# `data:` and the MIME type in any case (as images.py reads them), `;base64,` as written. ECMA-262 has no
# inline (?i), hence the classes.
_DATA_URL_PREFIX = (r"[Dd][Aa][Tt][Aa]:[Ii][Mm][Aa][Gg][Ee]/"
                    r"(?:[Pp][Nn][Gg]|[Jj][Pp][Ee]?[Gg]|[Ww][Ee][Bb][Pp]);base64,")
_MIB = 1024 * 1024
_MIB_EACH = f"{_images.MAX_IMAGE_BYTES // _MIB} MiB"
_MIB_TOTAL = f"{_images.MAX_TOTAL_BYTES // _MIB} MiB"
_MEGAPIXELS = f"{_images.MAX_PIXELS // 1_000_000} megapixels"
_IMAGE_LIMITS = (f"at most {_MIB_EACH} of file bytes (after base64 decoding) and {_MEGAPIXELS} per image, "
                 f"{_MIB_TOTAL} decoded in total, the whole body within --max-body-bytes; PNG, JPEG or WebP "
                 f"(the format is read from the bytes, not from the stated type), 8-bit RGB, RGBA, grey or "
                 f"palette, one frame, aspect ratio at most {_images.MAX_ASPECT}")
# A 16x16 PNG: the example request's image (decoded, preprocessed and answered like any other).
EXAMPLE_PNG = ("iVBORw0KGgoAAAANSUhEUgAAABAAAAAQCAIAAACQkWg2AAAAM0lEQVR42mNkYPggwMAAQxOQ2AVYxVkY"
               "BBhIAnTRMAGJW4DExi4+OP1A2N3I4qPxQBMNAMbcCp7XUD9WAAAAAElFTkSuQmCC")


def _example_request() -> dict:
    """The example request about a screenshot, with the screenshot. Its team question offers two of the
    example's three teams, as the published example always has (so that it does not change for users)."""
    body = support_ticket(state="The customer attached a screenshot: checkout fails with an error for every "
                                "card.")
    del body["questions"]["team"]["criteria"]["sales"]
    body["images"] = ["data:image/png;base64," + EXAMPLE_PNG]
    return body


EXAMPLE_REQUEST = _example_request()


def _images_schema(cloudflare: bool, no_images: bool) -> dict:
    """``images``: up to 4 items, each a data URL or ``{content_type, base64}`` (both modes read the same
    forms; the reference mode also takes ``null`` for "no images"). What JSON Schema cannot state (the limits
    on decoded bytes and pixels, decodability) is in the descriptions; breaking it is a 422 naming
    ``images[i]``. The custom formats name what a generator must produce to be accepted: a real image."""
    data_url = {"type": "string", "format": "image-data-url", "pattern": f"^{_DATA_URL_PREFIX}{_B64}$",
                "description": "a data URL, `data:image/png|jpeg|jpg|webp;base64,<base64>` (`data:` and the "
                               "type in any case); http(s) URLs, paths and bare base64 are never read",
                "example": "data:image/png;base64," + EXAMPLE_PNG}
    item_object = {"type": "object", "required": ["content_type", "base64"], "additionalProperties": False,
                   "description": "the image's MIME type and its raw base64 (no `data:` prefix)",
                   "properties": {
                       "content_type": {"type": "string", "enum": list(_images.CONTENT_TYPES),
                                        "description": "matched case-insensitively"},
                       "base64": {"type": "string", "format": "image-base64", "pattern": f"^{_B64}$",
                                  "description": "standard alphabet, padded, no whitespace"}},
                   "example": {"content_type": "image/png", "base64": EXAMPLE_PNG}}
    description = (f"Clef extension: up to {_images.MAX_IMAGES} embedded images, shown to the model before "
                   f"the state, in order; their tokens count as input tokens. Limits: {_IMAGE_LIMITS}. A "
                   f"request that breaks one is refused with 422 naming the item, e.g. `images[1]`. An empty "
                   f"array is a text-only request")
    schema = {"type": "array", "maxItems": _images.MAX_IMAGES, "items": {"oneOf": [data_url, item_object]}}
    if not cloudflare:
        schema["type"] = ["array", "null"]
        description += " (and so is null)"
    if no_images:
        # the validator reads them, the engine refuses any: only the empty array (or null) is answered
        schema["maxItems"] = 0
        description += (f". This deployment was started with --no-images: any image is refused "
                        f"(422, \"{NO_IMAGES}\")")
    schema["description"] = description + "."
    return schema


def _request_schema(cloudflare: bool, no_images: bool = False) -> dict:
    questions = {"type": "object", "minProperties": 1,
                 "additionalProperties": {"$ref": "#/components/schemas/Question"}}
    if cloudflare:
        questions.update(maxProperties=64, propertyNames={"pattern": "^[A-Za-z0-9_.-]{1,100}$"})
    return {"type": "object", "required": ["model", "questions"],
            # `document` is the TypeSafe draft's name for `state`: exactly one of the two.
            "oneOf": [{"required": ["state"]}, {"required": ["document"]}],
            "additionalProperties": not cloudflare,
            "properties": {"model": {"type": "string", "example": "clef-flash"},
                           "state": _STATE if cloudflare else _ANY,
                           "document": _STATE if cloudflare else _ANY,
                           "questions": questions,
                           "images": _images_schema(cloudflare, no_images)},
            # without a tower the example is the same request, text only (it must stay valid here)
            "examples": [{k: v for k, v in EXAMPLE_REQUEST.items() if k != "images" or not no_images}]}


def _cloudflare_request_schema(cloudflare: bool, no_images: bool = False) -> dict:
    """Workers AI: the model is in the path; a body may leave it out, or must name the same one (checked by
    the server; the schema can only say it is one of the two), bare or as the path names it."""
    schema = _request_schema(cloudflare, no_images)
    schema["required"] = ["questions"]
    schema["properties"]["model"] = {"type": "string",
                                     "pattern": r"^\s*(@cf/cloudflare/)?(clef|clef-flash)\s*$"}
    return schema


_PROBABILITY = {"type": "number", "minimum": 0, "maximum": 1}
_PROBABILITIES = {"type": "object", "additionalProperties": _PROBABILITY}
_ANSWER = {"oneOf": [
    {"type": "object", "required": ["type", "noul"], "additionalProperties": False,
     "properties": {"type": {"type": "string", "enum": ["noul"]}, "noul": _PROBABILITY}},
    {"type": "object", "required": ["type", "choice", "probabilities", "confidence"],
     "additionalProperties": False,
     "properties": {"type": {"type": "string", "enum": ["choice"]}, "choice": {"type": "string"},
                    "probabilities": _PROBABILITIES, "confidence": _PROBABILITY}},
    {"type": "object", "required": ["type", "score", "legend", "probabilities", "confidence"],
     "additionalProperties": False,
     "properties": {"type": {"type": "string", "enum": ["score"]}, "score": {"type": "number", "minimum": 0},
                    "legend": {"type": "object"}, "probabilities": _PROBABILITIES,
                    "confidence": _PROBABILITY}},
]}
_RESPONSE = {"type": "object", "required": ["model", "answers", "usage"],
             "properties": {"model": {"type": "string", "minLength": 1},
                            "answers": {"type": "object", "additionalProperties": _ANSWER},
                            "usage": {"type": "object", "required": ["input_tokens", "output_tokens"],
                                      "properties": {"input_tokens": {"type": "integer", "minimum": 0},
                                                     "output_tokens": {"type": "integer", "minimum": 0}}}}}
_ERROR = {"type": "object", "required": ["error", "detail"],
          "properties": {"error": {"type": "object", "required": ["message", "type"],
                                   "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                                  "field": {"type": "string"}, "limit": {"type": "string"}}},
                         "detail": {"type": "object", "required": ["message", "error_type"],
                                    "properties": {"message": {"type": "string"},
                                                   "error_type": {"type": "string"}}}}}
_CF_ENVELOPE = {"type": "object", "required": ["result", "success", "errors", "messages"],
                "properties": {"result": {"type": "object"}, "success": {"type": "boolean"},
                               "errors": {"type": "array", "items": {
                                   "type": "object", "required": ["message", "code"],
                                   "properties": {"message": {"type": "string"},
                                                  "code": {"type": "integer"}}}},
                               "messages": {"type": "array"}}}

_ERROR_STATUSES = {
    "400": "malformed JSON, a broken gzip/deflate/br/zstd body (or more than 2 codings stacked, more than 64 gzip "
           "members or zstd frames, an empty one), context overflow with --on-overflow reject "
           "(exceed_context_size_error)",
    "401": "missing or wrong API key (only with --api-key)",
    "408": "the body did not arrive within --body-timeout of the headers; the connection is closed",
    "413": "body larger than --max-body-bytes, on the wire or decoded, or longer to decode than its deadline; an "
           "image that becomes more image tokens once resized than --max-image-tokens (`field` `images[i]`), or "
           "images that together become more than --max-request-image-tokens (`field` `images`); a prompt longer "
           "than --max-prompt-tokens, or one its run's pace shows past the longest wait (`field` `state`)",
    "415": "Content-Type is not application/json, or a Content-Encoding other than gzip, deflate, br, zstd",
    "422": "schema violation; `field` names the path, `limit` the rule. For images (`field` `images[i]`, "
           f"or `images` for the count): more than {_images.MAX_IMAGES} images, a form other than a data URL "
           "or {content_type, base64} (URLs and paths are never read), a MIME type other than image/png, "
           "image/jpeg, image/jpg or image/webp, bad base64, bytes that are no decodable PNG, JPEG or WebP "
           f"(`image payload is invalid`), an image over {_MIB_EACH} or {_MEGAPIXELS}, or over {_MIB_TOTAL} "
           "in total. With `field` `images`: a deployment started with --no-images answers any image with "
           f"\"{NO_IMAGES}\", and one whose model has no usable vision tower with "
           "\"images: this model has no vision tower\" (or: its tower is incomplete)",
    "429": "overloaded: the work that runs before this request plus its own would exceed the wait it is "
           "allowed (--min-queue-wait, and --max-queue-wait for a prompt of --context-length tokens, shorter "
           "ones in proportion; reason queued_work; evicted when cheaper work admitted later displaced it from "
           "the queue), or the queue is full (queue_full); honour Retry-After",
    "500": "the device failed this request, or failed while running it",
    "503": "loading, draining, a device stalled, faulted or lost before the request reached it, or the request "
           "waited past --request-timeout; honour Retry-After",
}


def _json_content(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def _decision_responses(ok: dict, error: dict, cloudflare: bool) -> dict:
    responses = {"200": {"description": "answers", "content": _json_content(ok)}}
    for status, text in _ERROR_STATUSES.items():
        responses[status] = {"description": text, "content": _json_content(error)}
    if cloudflare:
        responses["404"] = {"description": "no such route", "content": _json_content(error)}
    return responses


def _operations(security: list) -> dict[str, dict]:
    """Each route's OpenAPI operation, by its operationId (the route table, server/routes.py, names them)."""
    decision_body = {"required": True,
                     "content": _json_content({"$ref": "#/components/schemas/SystemOneRequest"})}
    cloudflare_body = {"required": True,
                       "content": _json_content({"$ref": "#/components/schemas/CloudflareRequest"})}
    plain_503 = {"description": "not ready", "content": _json_content({"type": "object"})}
    operations = [
        {"summary": "Answer a System One request (bare body)", "operationId": "systemone",
         "security": security, "requestBody": decision_body,
         "responses": _decision_responses({"$ref": "#/components/schemas/SystemOneResponse"},
                                          {"$ref": "#/components/schemas/Error"}, False)},
        {"summary": "The same with Cloudflare Workers AI's envelope and error codes",
         "description": "The model path may also come as one percent-encoded segment, "
                        "`run/@cf%2Fcloudflare%2Fclef-flash`, as Cloudflare's SDKs send it.",
         "operationId": "cloudflareRun", "security": security,
         "parameters": [
             {"name": "account", "in": "path", "required": True,
              "schema": {"type": "string", "minLength": 1}},
             {"name": "model", "in": "path", "required": True,
              "schema": {"type": "string", "enum": ["clef", "clef-flash"]}}],
         "requestBody": cloudflare_body,
         "responses": _decision_responses({"$ref": "#/components/schemas/CloudflareEnvelope"},
                                          {"$ref": "#/components/schemas/CloudflareEnvelope"}, True)},
        {"summary": "Served model (TypeSafe shape)", "operationId": "models", "security": security,
         "responses": {"200": {"description": "models", "content": _json_content({
             "type": "object", "required": ["models"],
             "properties": {"models": {"type": "array", "items": {
                 "type": "object", "required": ["name", "description", "release_date"]}}}})},
             "401": {"description": "missing or wrong API key",
                     "content": _json_content({"$ref": "#/components/schemas/Error"})},
             "503": {"description": "loading",
                     "content": _json_content({"$ref": "#/components/schemas/Error"})}}},
        {"summary": "Readiness: 200 once loaded, warmed and self-checked, while no device is stalled or faulted",
         "operationId": "health", "security": [],
         "responses": {"200": {"description": "ready", "content": _json_content({"type": "object"})},
                       "503": plain_503}},
        {"summary": "Liveness: the event loop answers and the server has not failed", "operationId": "live",
         "security": [],
         "responses": {"200": {"description": "alive", "content": _json_content({"type": "object"})},
                       "503": {"description": "failed (a device lost or given up): exiting",
                               "content": _json_content({"type": "object"})}}},
        {"summary": "Prometheus metrics", "operationId": "metrics", "security": [],
         "responses": {"200": {"description": "Prometheus text format",
                               "content": {"text/plain": {"schema": {"type": "string"}}}}}},
        {"summary": "This document", "operationId": "openapi", "security": [],
         "responses": {"200": {"description": "OpenAPI 3.1", "content": _json_content({"type": "object"})}}},
        {"summary": "Playground page", "operationId": "playground", "security": [],
         "responses": {"200": {"description": "HTML", "content": {"text/html": {"schema": {"type": "string"}}}}}},
        {"summary": "The example request, the body the playground starts from", "operationId": "example",
         "security": [],
         "responses": {"200": {"description": "a System One request",
                               "content": _json_content({"$ref": "#/components/schemas/SystemOneRequest"})}}},
    ]
    return {operation["operationId"]: operation for operation in operations}


def build_spec(config: ServiceConfig, api_key: str | None, paths: dict[str, dict[str, str]],
               prefix: str = "") -> dict:
    """The document for a server with ``config`` whose routes are ``paths`` (path -> method -> operationId: the
    route table, server/routes.py), mounted under ``prefix`` ("" at the root; else it is the spec's server
    URL)."""
    cloudflare = config.engine.validation == "cloudflare"
    operations = _operations([{"bearer": []}, {"apiKey": []}] if api_key else [])
    spec = {
        "openapi": "3.1.0",
        "info": {"title": "clefcore", "version": __version__,
                 "description": "System One decisions (Cloudflare Clef-flash) served by clefcore."},
        "paths": {path: {method: operations[operation] for method, operation in methods.items()}
                  for path, methods in paths.items()},
        "components": {
            "schemas": {"SystemOneRequest": _request_schema(cloudflare, not config.engine.images),
                        "Question": _question_schema(cloudflare),
                        "CloudflareRequest": _cloudflare_request_schema(cloudflare, not config.engine.images),
                        "SystemOneResponse": _RESPONSE, "Error": _ERROR, "CloudflareEnvelope": _CF_ENVELOPE},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                "apiKey": {"type": "apiKey", "in": "header", "name": "X-Api-Key"}},
        },
    }
    if prefix:
        spec["servers"] = [{"url": prefix}]
    return spec
