"""Property-based fuzz of request bodies over real HTTP: whatever the body, the server answers with a
well-formed JSON status below 500 on the same kept-alive connection (no 500, no dropped connection).

Bodies come from three generators: arbitrary JSON values, near-valid System One requests with every field
drawn from a wide domain (so validation is exercised deep inside questions), and raw bytes."""

from __future__ import annotations

import http.client
import json
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_harness import Server, check_client_rules

ALLOWED = {200, 400, 413, 422}

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=12), inner, max_size=5)), max_leaves=25)
descriptions = st.one_of(st.text(max_size=30), st.none(), json_values)
ids = st.one_of(st.from_regex(r"[A-Za-z0-9_.-]{1,12}", fullmatch=True), st.text(max_size=120))


@st.composite
def questions(draw):
    kind = draw(st.sampled_from(["noul", "choice", "score", "box", 7, None]))
    question = {"type": kind}
    if draw(st.booleans()):
        question["instructions"] = draw(st.one_of(st.text(max_size=60), json_values))
    if kind == "choice" or draw(st.booleans()):
        question["criteria"] = draw(st.one_of(
            st.dictionaries(ids, descriptions, max_size=8), st.lists(descriptions, max_size=12), json_values))
    if kind == "score":
        question["criteria"] = draw(st.lists(descriptions, min_size=0, max_size=12))
    if draw(st.integers(0, 9)) == 0:
        question[draw(st.text(max_size=8))] = draw(json_values)
    return question


@st.composite
def near_valid_requests(draw):
    body = {"model": draw(st.one_of(st.sampled_from(["clef", "clef-flash", "jev-latest"]), json_values)),
            "state": draw(st.one_of(st.text(max_size=300), json_values)),
            "questions": draw(st.dictionaries(ids, questions(), min_size=0, max_size=6))}
    for key in draw(st.lists(st.sampled_from(["model", "state", "questions"]), max_size=1)):
        del body[key]
    if draw(st.integers(0, 9)) == 0:
        body[draw(st.sampled_from(["images", "document", "temperature", "x"]))] = draw(json_values)
    return json.dumps(body, ensure_ascii=draw(st.booleans())).encode()


good_ids = st.from_regex(r"[A-Za-z0-9_.-]{1,20}", fullmatch=True)
good_text = st.text(min_size=1, max_size=80)


@st.composite
def valid_requests(draw):
    """Requests both rule sets accept, so a good share of the fuzz goes through the model."""
    def question():
        kind = draw(st.sampled_from(["noul", "choice", "score"]))
        structured = st.dictionaries(good_ids, good_text, min_size=1, max_size=3)
        q = {"type": kind, "instructions": draw(st.one_of(good_text, structured))}
        if kind == "noul" and draw(st.booleans()):
            q["criteria"] = {"true": draw(good_text), "false": draw(st.one_of(good_text, st.none()))}
        if kind == "choice":
            q["criteria"] = draw(st.dictionaries(good_ids, descriptions, min_size=2, max_size=6))
        if kind == "score":
            q["criteria"] = draw(st.lists(st.one_of(good_text, st.lists(good_text, min_size=1, max_size=2)),
                                          min_size=2, max_size=5))
        return q
    qids = draw(st.lists(good_ids, min_size=1, max_size=4, unique=True))
    body = {"model": draw(st.sampled_from(["clef", "clef-flash", "jev-latest"])),
            "state": draw(st.one_of(st.text(max_size=400), st.dictionaries(good_ids, json_values, max_size=4),
                                    st.lists(json_values, max_size=4))),
            "questions": {qid: question() for qid in qids}}
    return json.dumps(body, ensure_ascii=draw(st.booleans())).encode()


bodies = st.one_of(valid_requests(), near_valid_requests(), near_valid_requests(),
                   json_values.map(lambda v: json.dumps(v).encode()),
                   st.binary(max_size=200))


class KeptAlive:
    """One HTTP/1.1 connection for the whole run: a server-side crash or a dropped connection shows up
    as an exception on the next request instead of being hidden by a fresh connect."""

    def __init__(self, port: int):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.statuses: Counter = Counter()

    def post(self, data: bytes):
        self.conn.request("POST", "/v1/systemone", body=data, headers={"Content-Type": "application/json"})
        reply = self.conn.getresponse()
        self.statuses[reply.status] += 1
        return reply.status, reply.getheader("x-request-id"), reply.read()


@pytest.fixture(scope="module", params=["cloudflare", "reference"])
def client(request):
    with Server("--validation", request.param, "--max-body-bytes", "65536").wait_ready() as s:
        connection = KeptAlive(s.port)
        yield connection, request.param, s
        assert s.proc.poll() is None
        print(f"\nfuzz ({request.param} rules): {sum(connection.statuses.values())} bodies, "
              f"statuses {dict(sorted(connection.statuses.items()))}")
        # The generators must reach both the model and the validator, or the fuzz proves little.
        assert connection.statuses[200] >= 20 and connection.statuses[422] >= 100, connection.statuses


def run_case(client, data: bytes) -> None:
    connection, _, _ = client
    status, request_id, payload = connection.post(data)
    assert status in ALLOWED, (status, data[:300], payload[:300])
    assert request_id
    body = json.loads(payload)
    if status == 200:
        check_client_rules(json.loads(data), body)
    else:
        assert body["error"]["message"] and body["detail"]["error_type"]


@pytest.mark.slow
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(data=bodies)
def test_fuzzed_bodies_never_500_and_never_drop_the_connection(client, data):
    run_case(client, data)
