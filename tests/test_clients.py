"""The client SDKs System One services are called with (TypeSafe's, Cloudflare's, OpenAI's as a generic
client), at their defaults, against a real `clefcore serve` (tiny golden checkpoint, CPU): each answer equals
the in-process engine's, each refusal reaches the client as its 4xx. Two of their habits broke the server
before: TypeSafe's SDK zstd-compresses bodies of 1 KiB or more, and Cloudflare's percent-encodes the model as
one path segment (`run/@cf%2Fcloudflare%2Fclef-flash`)."""

from __future__ import annotations

import copy

import pytest

from server_harness import SUPPORT_TICKET, Server, ticket

typesafe_sdk = pytest.importorskip("typesafe_sdk")
cloudflare = pytest.importorskip("cloudflare")
openai = pytest.importorskip("openai")

KEY = "clients-test-key"
ACCOUNT = "0123456789abcdef0123456789abcdef"
# A state of a few KiB (the size that failed with TypeSafe's SDK): a support thread, not repeated filler.
LONG_STATE = "\n".join(
    f"[{9 + i // 60:02d}:{i % 60:02d}] customer {1000 + i * 37}: checkout step {i % 5} returned HTTP "
    f"5{i % 3}2 after {120 + 13 * i} ms; cart total {19.5 + i:.2f} EUR; retry {i % 4} failed"
    for i in range(60))
SHORT_STATE = "Checkout has been failing for every customer for the last hour."


@pytest.fixture(scope="module", autouse=True)
def local_only():
    """The SDKs only talk to 127.0.0.1 here: a proxy configured for the machine must not be used."""
    with pytest.MonkeyPatch.context() as env:
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
            env.delenv(name, raising=False)
            env.delenv(name.lower(), raising=False)
        yield


@pytest.fixture(scope="module")
def server():
    with Server("--api-key", KEY) as s:
        s.wait_ready()
        yield s


def last_request_line(server: Server, path_part: str) -> dict:
    lines = server.wait_for_events("request", lambda events: any(path_part in e["path"] for e in events))
    return [e for e in lines if path_part in e["path"]][-1]


# --- TypeSafe's SDK ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def typesafe(server):
    with typesafe_sdk.TypeSafeClient(api_key=KEY, base_url=server.base) as client:
        yield client


def typed_questions(questions: dict) -> dict:
    """The SDK's own question classes for plain question dicts (how its documentation builds them)."""
    kinds = {"noul": typesafe_sdk.Noul, "choice": typesafe_sdk.Choice, "score": typesafe_sdk.Score}
    return {qid: kinds[q["type"]](**{k: v for k, v in q.items() if k != "type"})
            for qid, q in questions.items()}


def assert_typesafe_answers(sdk_response, expected: dict) -> None:
    """The SDK's parsed answers carry the engine's values (score keys become ints in the SDK)."""
    assert sdk_response.model == expected["model"]
    assert sdk_response.usage.input_tokens == expected["usage"]["input_tokens"]
    assert sdk_response.usage.output_tokens == 0
    assert list(sdk_response.answers) == list(expected["answers"])
    for qid, want in expected["answers"].items():
        got = sdk_response.answers[qid]
        assert got.type == want["type"]
        if want["type"] == "noul":
            assert got.noul == want["noul"]
        elif want["type"] == "choice":
            assert (got.choice, got.confidence, got.probabilities) == (
                want["choice"], want["confidence"], want["probabilities"])
        else:
            assert (got.score, got.confidence) == (want["score"], want["confidence"])
            assert {str(k): v for k, v in got.probabilities.items()} == want["probabilities"]
            assert {str(k): v for k, v in got.legend.items()} == want["legend"]


@pytest.mark.parametrize("state", [SHORT_STATE, LONG_STATE], ids=["short", "long"])
def test_typesafe_system_one(server, engine, typesafe, state):
    questions = SUPPORT_TICKET["questions"]
    reply = typesafe.system_one(state=state, questions=typed_questions(questions))
    # What the SDK sends by default: its default model name, the state, the questions.
    expected = engine.decide({"model": "jev-latest", "state": state, "questions": questions})
    assert reply.raw_http_response.json() == expected
    assert_typesafe_answers(reply, expected)
    line = last_request_line(server, "/v1/systemone")
    assert line["status"] == 200 and line["prompt_tokens"] == expected["usage"]["input_tokens"]
    if len(state) > 1024:  # the SDK compresses a body of 1 KiB or more with zstd whenever it can
        assert line.get("content_encoding") == "zstd", line


def test_typesafe_dict_questions_and_object_state(engine, typesafe):
    state = {"ticket": {"subject": "Refund", "body": LONG_STATE}, "customer": {"plan": "pro"}}
    questions = copy.deepcopy(SUPPORT_TICKET["questions"])
    reply = typesafe.system_one(state=state, questions=questions, model="clef-flash")
    expected = engine.decide({"model": "clef-flash", "state": state, "questions": questions})
    assert reply.raw_http_response.json() == expected
    assert_typesafe_answers(reply, expected)


def test_typesafe_models_list(engine, typesafe):
    models = typesafe.models.list()
    assert [m.name for m in models.models] == [engine.model_name]
    assert models.models[0].release_date == "2026-10-01" and models.models[0].description


def test_typesafe_sees_refusals_as_its_4xx_errors(server, typesafe):
    questions = {"team": {"type": "choice", "instructions": "Which team?",
                          "criteria": {"billing": "Payments"}}}
    with pytest.raises(typesafe_sdk.TypeSafeUnprocessableEntityError) as refused:
        typesafe.system_one(state=LONG_STATE, questions=questions)
    assert "questions.team.criteria" in str(refused.value)
    with typesafe_sdk.TypeSafeClient(api_key="wrong-key", base_url=server.base) as stranger:
        with pytest.raises(typesafe_sdk.TypeSafeAuthenticationError):
            stranger.system_one(state="x", questions=SUPPORT_TICKET["questions"])


# --- Cloudflare's SDK ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cf(server):
    with cloudflare.Cloudflare(api_token=KEY, base_url=server.base + "/client/v4") as client:
        yield client


@pytest.mark.parametrize("model", ["clef-flash", "clef"])
@pytest.mark.parametrize("state", [SHORT_STATE, LONG_STATE], ids=["short", "long"])
def test_cloudflare_ai_run(server, engine, cf, model, state):
    body = ticket(state, model=model)
    result = cf.ai.run(f"@cf/cloudflare/{model}", account_id=ACCOUNT, extra_body=body)
    assert result == engine.decide(body)
    line = last_request_line(server, "/ai/run/")
    assert line["status"] == 200 and line["route"] == "/client/v4/accounts/{account}/ai/run/{model}"


def test_cloudflare_body_may_leave_the_model_to_the_path(engine, cf):
    body = {k: v for k, v in SUPPORT_TICKET.items() if k != "model"}
    result = cf.ai.run("@cf/cloudflare/clef-flash", account_id=ACCOUNT, extra_body=body)
    assert result == engine.decide(dict(body, model="clef-flash"))


def test_cloudflare_legacy_key_auth(server, engine):
    with cloudflare.Cloudflare(api_email="ops@example.com", api_key=KEY,
                               base_url=server.base + "/client/v4") as client:
        body = ticket("Legacy key and email headers.", model="clef-flash")
        assert client.ai.run("@cf/cloudflare/clef-flash", account_id=ACCOUNT, extra_body=body) == \
            engine.decide(body)


def test_cloudflare_refusals(cf):
    with pytest.raises(cloudflare.BadRequestError) as wrong_model:
        cf.ai.run("@cf/meta/llama-3.1-8b-instruct", account_id=ACCOUNT, extra_body=ticket("x", model="clef"))
    assert wrong_model.value.body["errors"][0]["code"] == 7000
    assert "@cf/meta/llama-3.1-8b-instruct" in wrong_model.value.body["errors"][0]["message"]
    with pytest.raises(cloudflare.BadRequestError) as mismatch:
        cf.ai.run("@cf/cloudflare/clef-flash", account_id=ACCOUNT, extra_body=ticket("x", model="clef"))
    assert "does not match" in mismatch.value.body["errors"][0]["message"]
    bad = ticket(LONG_STATE, model="clef-flash")
    bad["questions"]["severity"]["criteria"] = ["only one level"]
    with pytest.raises(cloudflare.UnprocessableEntityError) as invalid:
        cf.ai.run("@cf/cloudflare/clef-flash", account_id=ACCOUNT, extra_body=bad)
    (error,) = invalid.value.body["errors"]
    assert error["code"] == 5012 and "questions.severity.criteria" in error["message"]


# --- OpenAI's SDK, as a generic OpenAI-style client of /v1/systemone ----------------------------------------

@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(api_key=KEY, base_url=server.base + "/v1", max_retries=0) as client:
        yield client


def test_openai_client_posts_systemone(engine, oai):
    for body in (SUPPORT_TICKET, ticket(LONG_STATE, model="cloudflare/clef-flash")):
        assert oai.post("/systemone", body=body, cast_to=object) == engine.decide(body)


def test_openai_client_reads_the_error_object(oai):
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        oai.post("/systemone", body=ticket("x", questions={}), cast_to=object)
    assert refused.value.body["field"] == "questions" and refused.value.body["limit"]
    with pytest.raises(openai.BadRequestError) as malformed:
        oai.post("/systemone", content=b'{"model": "clef", ', cast_to=object,
                 options={"headers": {"Content-Type": "application/json"}})
    assert malformed.value.body["type"] == "invalid_json"
