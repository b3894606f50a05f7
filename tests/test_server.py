"""`clefcore serve` over real HTTP: every route, every client-error status, the Cloudflare envelope, and the
client rules of systemone-protocol.md §11. One server (golden tiny checkpoint, CPU) for the module."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_harness import GOLDEN, SUPPORT_TICKET, Server, check_client_rules, same_answers, ticket

CF = "/client/v4/accounts/0123abc/ai/run/@cf/cloudflare"


@pytest.fixture(scope="module")
def server():
    with Server("--max-body-bytes", "20000").wait_ready() as s:
        yield s


def error_of(reply, status: int, kind: str) -> dict:
    assert reply.status == status, reply
    assert reply.headers["content-type"].startswith("application/json")
    body = reply.json()
    assert body["error"]["type"] == kind, body
    assert body["detail"]["message"] == body["error"]["message"]
    return body["error"]


# --- plain routes -----------------------------------------------------------------------------------------

def test_health_live_models(server):
    health = server.get("/health")
    assert health.status == 200 and health.json()["status"] == "ok"
    assert health.json()["device"] == "cpu" and health.json()["precision"] == "fp32"
    assert health.json()["precision_fallbacks"] == 0 and "cublas" not in health.json()
    assert server.get("/live").json() == {"status": "alive"}
    models = server.get("/v1/models").json()["models"]
    assert set(models[0]) >= {"name", "description", "release_date"}
    assert models[0]["max_context_length"] == 24576


def test_every_response_has_a_request_id_one_log_line_and_no_versions(server):
    seen = set()
    for reply in (server.get("/health"), server.get("/nope"), server.decide(SUPPORT_TICKET),
                  server.post("/v1/systemone", "{"), server.post("/v1/systemone", "x" * 30000),
                  server.get("/metrics"), server.get("/")):
        # aiohttp's default Server header (Python/3.x aiohttp/3.y) tells a scanner which known holes to try
        assert reply.headers["server"] == "clefcore", (reply.status, reply.headers["server"])
        rid = reply.headers["x-request-id"]
        assert rid and rid not in seen
        seen.add(rid)
    echoed = server.get("/live", headers={"x-request-id": "trace-123.abc"})
    assert echoed.headers["x-request-id"] == "trace-123.abc"
    unsafe = server.get("/live", headers={"x-request-id": "bad id\twith spaces"})
    assert unsafe.headers["x-request-id"] != "bad id\twith spaces"
    logged = [e["request_id"] for e in server.wait_for_events(
        "request", lambda events: seen <= {e["request_id"] for e in events})]
    for rid in seen | {"trace-123.abc"}:
        assert logged.count(rid) == 1, rid
    line = next(e for e in server.events("request") if e["path"] == "/v1/systemone" and e["status"] == 200)
    assert {"duration_ms", "prompt_tokens", "queue_ms", "prefill_ms", "batch_requests", "method"} <= set(line)


def test_metrics_exposition(server):
    server.decide(SUPPORT_TICKET)
    reply = server.get("/metrics")
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/plain")
    text = reply.text
    for name in ("clef_requests_total", "clef_queue_depth", "clef_batch_size_requests_bucket",
                 "clef_prompt_tokens_total", "clef_queue_wait_seconds_bucket", "clef_prepare_wait_seconds_bucket",
                 "clef_prefill_seconds_bucket", "clef_request_duration_seconds_bucket", "clef_device_memory_bytes",
                 "clef_ready 1.0"):
        assert name in text, name
    assert 'clef_engine_info{device="cpu",precision="fp32"} 1.0' in text
    assert "clef_precision_fallbacks_total 0.0" in text and "clef_cublas_available" not in text
    assert server.metric("clef_requests_total", 'route="/v1/systemone",status="200"') >= 1
    # one spelling of a route on every series that carries it
    assert server.metric("clef_request_duration_seconds_count", 'route="/v1/systemone"') >= 1
    assert 'route="systemone"' not in text


def test_labelled_counters_start_at_zero_for_every_known_label_value(server):
    """Panels and ratios show 0 before the first refusal or failure, not "No data"."""
    from clefcore.server import admission, errors
    families = {f.name: f for f in text_string_to_metric_families(server.get("/metrics").text)}
    rejected = {(s.labels["reason"], s.labels["size"]) for s in families["clef_requests_rejected"].samples
                if s.name.endswith("_total")}
    assert rejected == {(r.value, s) for r in admission.Reason for s in admission.SIZE_LABELS}
    failures = {s.labels["type"] for s in families["clef_request_failures"].samples if s.name.endswith("_total")}
    assert failures == set(errors.SERVER_KINDS)
    # and those are every kind a 5xx answer has
    made = [errors.unavailable("draining", 1), errors.timed_out(30), errors.inference_failed(ValueError("x")),
            errors.internal(ValueError("x"))]
    assert all(e.status >= 500 for e in made) and [e.kind for e in made] == list(errors.SERVER_KINDS)


def test_openapi(server):
    spec = server.get("/openapi.json").json()
    assert "/v1/systemone" in spec["paths"] and "/health" in spec["paths"]
    assert spec["components"]["schemas"]["SystemOneRequest"]["properties"]["questions"]["maxProperties"] == 64


def test_unknown_route_and_method(server):
    assert error_of(server.get("/v2/whatever"), 404, "not_found_error")
    reply = server.get("/v1/systemone")
    error_of(reply, 405, "method_not_allowed")
    assert "POST" in reply.headers["allow"]


# --- decisions ------------------------------------------------------------------------------------------

def test_golden_requests_answer_like_the_engine(server, engine):
    """Every golden request the Cloudflare rules accept (SUPPORT_TICKET among them) answers exactly like the
    in-process engine, in JSON with no output tokens; the ones they refuse are 422 with a field path."""
    answered = refused = 0
    lines = (GOLDEN / "requests.jsonl").read_text().splitlines()
    assert SUPPORT_TICKET in map(json.loads, lines)
    for line in lines:
        reply = server.post("/v1/systemone", line)
        body = json.loads(line)
        if reply.status == 200:
            assert reply.headers["content-type"].startswith("application/json")
            check_client_rules(body, reply.json())
            assert reply.json()["usage"]["output_tokens"] == 0
            assert same_answers(reply.json(), engine.decide(body), tol=0)
            answered += 1
        else:
            assert reply.status == 422, reply
            assert reply.json()["error"]["field"]
            refused += 1
    assert answered >= 10 and refused >= 1


def test_document_alias_and_object_state(server):
    body = {"model": "jev-latest", "document": {"ticket": "refund please", "n": [1, 2.5]},
            "questions": {"refund": {"type": "noul", "instructions": "Refund asked?"}}}
    reply = server.decide(body)
    assert reply.status == 200, reply
    check_client_rules(body, reply.json())


# --- client errors --------------------------------------------------------------------------------------

def test_400_malformed_json_and_bad_utf8(server):
    for data in ("{\"model\": ", b"{\"model\": \"\xff\"}", "[" * 5000 + "]" * 5000, ""):
        error_of(server.post("/v1/systemone", data), 400, "invalid_json")


def test_415_content_type(server):
    for headers in ({"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"},
                    {"Content-Type": "application/xml"}, {}):
        error_of(server.request("POST", "/v1/systemone", SUPPORT_TICKET, headers), 415, "unsupported_media_type")
    ok = server.post("/v1/systemone", json.dumps(SUPPORT_TICKET),
                     {"Content-Type": "application/json; charset=utf-8"})
    assert ok.status == 200


def test_413_body_too_large_with_and_without_content_length(server):
    big = ticket("x" * 30000)
    err = error_of(server.decide(big), 413, "request_too_large")
    assert err["limit"] == "20000 bytes"
    # Chunked upload (http.client sends an iterable body so): no Content-Length, the server counts while reading.
    payload = json.dumps(big).encode()
    chunks = (payload[i:i + 4096] for i in range(0, len(payload), 4096))
    error_of(server.request("POST", "/v1/systemone", chunks, {"Content-Type": "application/json"}), 413,
             "request_too_large")


@pytest.mark.parametrize("mutate, field, limit", [
    (lambda b: b["questions"].update({f"q{i}": {"type": "noul", "instructions": "x"} for i in range(70)}),
     "questions", "1..64 questions"),
    (lambda b: b["questions"]["team"].update(criteria={"only": "one"}), "questions.team.criteria", None),
    (lambda b: b["questions"]["severity"].update(criteria=[str(i) for i in range(11)]),
     "questions.severity.criteria", None),
    (lambda b: b["questions"]["urgent"].update(instructions=""), "questions.urgent.instructions", None),
    (lambda b: b.update(temperature=0.5), "temperature", None),
    (lambda b: b["questions"].update({"bad id": {"type": "noul", "instructions": "x"}}), "questions.bad id",
     "[A-Za-z0-9_.-]{1,100}"),
    (lambda b: b["questions"]["urgent"].update(type="box"), "questions.urgent.type",
     "noul, choice, or score"),
])
def test_422_schema_violations_name_field_and_limit(server, mutate, field, limit):
    body = json.loads(json.dumps(SUPPORT_TICKET))
    mutate(body)
    err = error_of(server.decide(body), 422, "invalid_request_error")
    assert err["field"] == field, err
    if limit is not None:
        assert err["limit"] == limit, err
    assert server.get("/health").status == 200


# Request 0 of shared/golden-images, its PNG data URL cut to the signature and IHDR (refused before decoding).
GOLDEN_IMAGES_0 = {
    "model": "clef-flash",
    "images": ["data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAEAAAAAw"],
    "state": "Screenshot attached: the checkout page shows a red error banner.",
    "questions": {"error_visible": {"type": "noul", "instructions": "Does the screenshot show an error?"}},
}


def test_images_get_422_in_both_validation_modes(server):
    # Reference validation used to drop `images` and answer 200 from the text alone (issue 21). The image here is
    # cut to its PNG header: it is read, and refused as undecodable, by item.
    text_only = {key: value for key, value in GOLDEN_IMAGES_0.items() if key != "images"}
    with Server("--validation", "reference").wait_ready() as reference:
        for s in (server, reference):
            err = error_of(s.decide(GOLDEN_IMAGES_0), 422, "invalid_request_error")
            assert err["field"] == "images[0]" and err["message"].startswith("images[0]: image payload is invalid")
            empty = s.decide(dict(GOLDEN_IMAGES_0, images=[]))  # no image in it: a text-only request
            assert empty.status == 200 and empty.json() == s.decide(text_only).json()


def test_context_overflow_reject_and_truncate():
    long_state = ticket("log line with words " * 200)
    with Server("--context-length", "400", "--on-overflow", "reject").wait_ready() as s:
        err = error_of(s.decide(long_state), 400, "exceed_context_size_error")
        assert err["n_ctx"] == 400 and err["n_prompt_tokens"] > 400
        assert err["limit"] == "400 tokens"
        assert s.decide(SUPPORT_TICKET).status == 200
        cf = s.post(f"{CF}/clef", long_state)
        assert cf.status == 400 and cf.json()["errors"][0]["code"] == 5021
    with Server("--context-length", "400").wait_ready() as s:
        reply = s.decide(long_state)
        assert reply.status == 200 and reply.json()["usage"]["input_tokens"] == 400


# --- Cloudflare route -----------------------------------------------------------------------------------

def test_cloudflare_envelope(server, engine):
    body = dict(SUPPORT_TICKET, model=" clef-flash ")
    reply = server.post(f"{CF}/clef-flash", body)
    assert reply.status == 200, reply
    assert reply.headers["cf-ai-req-id"] == reply.headers["x-request-id"]
    assert reply.headers["cache-control"] == "no-store"
    envelope = reply.json()
    assert envelope["success"] is True and envelope["errors"] == [] and envelope["messages"] == []
    result = envelope["result"]
    assert result["model"] == "clef-flash"
    check_client_rules(body, result)
    assert result["answers"] == engine.decide(SUPPORT_TICKET)["answers"]


def cf_error(reply, status: int, code: int) -> str:
    assert reply.status == status, reply
    body = reply.json()
    assert body["success"] is False and body["result"] == {} and body["messages"] == []
    assert body["errors"][0]["code"] == code, body
    assert reply.headers["cf-ai-req-id"] in body["errors"][0]["message"]
    return body["errors"][0]["message"]


def test_cloudflare_errors(server):
    cf_error(server.post(f"{CF}/clef", "{nope"), 400, 6003)
    cf_error(server.post(f"{CF}/clef", {"model": "clef", "state": "x"}), 400, 5006)
    cf_error(server.post(f"{CF}/llama", SUPPORT_TICKET), 400, 7000)
    cf_error(server.post(f"{CF}/clef-flash", SUPPORT_TICKET), 400, 5006)  # body says clef, path clef-flash
    bad = dict(SUPPORT_TICKET, questions={f"q{i}": {"type": "noul", "instructions": "x"} for i in range(65)})
    message = cf_error(server.post(f"{CF}/clef", bad), 422, 5012)
    nested = json.loads(message[len("AiError: AiError: "):message.rindex(" (")])
    assert nested["error"]["details"]["fieldErrors"]["questions"]
    cf_error(server.post(f"{CF}/clef", ticket("y" * 30000)), 413, 5021)
    cf_error(server.request("POST", f"{CF}/clef", json.dumps(SUPPORT_TICKET), {"Content-Type": "text/plain"}),
             415, 6003)


# --- auth -----------------------------------------------------------------------------------------------

def test_api_key():
    with Server("--api-key", "s3cret").wait_ready() as s:
        error_of(s.decide(SUPPORT_TICKET), 401, "authentication_error")
        assert s.decide(SUPPORT_TICKET, headers={"Authorization": "Bearer wrong"}).status == 401
        assert s.decide(SUPPORT_TICKET, headers={"Authorization": "Bearer s3cret"}).status == 200
        assert s.decide(SUPPORT_TICKET, headers={"X-Api-Key": "s3cret"}).status == 200
        assert s.get("/v1/models").status == 401
        cf = s.post(f"{CF}/clef", SUPPORT_TICKET)
        assert cf.status == 401 and cf.json()["errors"][0]["code"] == 10000
        for open_path in ("/health", "/live", "/metrics", "/openapi.json", "/", "/example"):
            assert s.get(open_path).status == 200, open_path
