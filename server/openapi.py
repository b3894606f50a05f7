"""The OpenAPI 3.1 description served at ``/openapi.json``.

Built from the running configuration, so the limits it states are the ones this server enforces
(Cloudflare's with ``--validation cloudflare``, the reference's looser ones otherwise). The request schema
mirrors systemone-protocol.md §3 and the response schema its §5, including the exact answer field sets
that strict clients check (§11).
"""

from __future__ import annotations

import argparse

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


def _request_schema(cloudflare: bool) -> dict:
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
                           "questions": questions}}


def _cloudflare_request_schema(cloudflare: bool) -> dict:
    """Workers AI: the model is in the path; a body may leave it out, or must name the same one (checked by
    the server; the schema can only say it is one of the two), bare or as the path names it."""
    schema = _request_schema(cloudflare)
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
    "400": "malformed JSON, a broken gzip/deflate/br/zstd body, context overflow with --on-overflow reject "
           "(exceed_context_size_error)",
    "401": "missing or wrong API key (only with --api-key)",
    "413": "body larger than --max-body-bytes, on the wire or decoded",
    "415": "Content-Type is not application/json, or a Content-Encoding other than gzip, deflate, br, zstd",
    "422": "schema violation; `field` names the path, `limit` the rule",
    "429": "overloaded: the queued work would exceed the wait budget (reason queued_work) or the queue is full "
           "(queue_full); honour Retry-After",
    "500": "the device failed this request",
    "503": "loading, draining, or the request waited past --request-timeout; honour Retry-After",
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


def build_spec(config: argparse.Namespace) -> dict:
    cloudflare = config.validation == "cloudflare"
    security = [{"bearer": []}, {"apiKey": []}] if config.api_key else []
    decision_body = {"required": True,
                     "content": _json_content({"$ref": "#/components/schemas/SystemOneRequest"})}
    cloudflare_body = {"required": True,
                       "content": _json_content({"$ref": "#/components/schemas/CloudflareRequest"})}
    plain_503 = {"description": "not ready", "content": _json_content({"type": "object"})}
    return {
        "openapi": "3.1.0",
        "info": {"title": "clefcore", "version": "0.1.0",
                 "description": "System One decisions (Cloudflare Clef-flash) served by clefcore."},
        "paths": {
            "/v1/systemone": {"post": {
                "summary": "Answer a System One request (bare body)", "operationId": "systemone",
                "security": security, "requestBody": decision_body,
                "responses": _decision_responses({"$ref": "#/components/schemas/SystemOneResponse"},
                                                 {"$ref": "#/components/schemas/Error"}, False)}},
            "/client/v4/accounts/{account}/ai/run/@cf/cloudflare/{model}": {"post": {
                "summary": "The same with Cloudflare Workers AI's envelope and error codes",
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
                                                 {"$ref": "#/components/schemas/CloudflareEnvelope"}, True)}},
            "/v1/models": {"get": {
                "summary": "Served model (TypeSafe shape)", "operationId": "models", "security": security,
                "responses": {"200": {"description": "models", "content": _json_content({
                    "type": "object", "required": ["models"],
                    "properties": {"models": {"type": "array", "items": {
                        "type": "object", "required": ["name", "description", "release_date"]}}}})},
                    "401": {"description": "missing or wrong API key",
                            "content": _json_content({"$ref": "#/components/schemas/Error"})},
                    "503": {"description": "loading",
                            "content": _json_content({"$ref": "#/components/schemas/Error"})}}}},
            "/health": {"get": {"summary": "Readiness: 200 once loaded, warmed and self-checked",
                                "operationId": "health", "security": [],
                                "responses": {"200": {"description": "ready",
                                                      "content": _json_content({"type": "object"})},
                                              "503": plain_503}}},
            "/live": {"get": {"summary": "Liveness: the event loop answers", "operationId": "live",
                              "security": [],
                              "responses": {"200": {"description": "alive",
                                                    "content": _json_content({"type": "object"})}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "operationId": "metrics", "security": [],
                                 "responses": {"200": {"description": "Prometheus text format",
                                                       "content": {"text/plain": {
                                                           "schema": {"type": "string"}}}}}}},
            "/openapi.json": {"get": {"summary": "This document", "operationId": "openapi", "security": [],
                                      "responses": {"200": {"description": "OpenAPI 3.1",
                                                            "content": _json_content({"type": "object"})}}}},
            "/": {"get": {"summary": "Playground page", "operationId": "playground", "security": [],
                          "responses": {"200": {"description": "HTML",
                                                "content": {"text/html": {"schema": {"type": "string"}}}}}}},
        },
        "components": {
            "schemas": {"SystemOneRequest": _request_schema(cloudflare),
                        "Question": _question_schema(cloudflare),
                        "CloudflareRequest": _cloudflare_request_schema(cloudflare),
                        "SystemOneResponse": _RESPONSE, "Error": _ERROR, "CloudflareEnvelope": _CF_ENVELOPE},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                "apiKey": {"type": "apiKey", "in": "header", "name": "X-Api-Key"}},
        },
    }
