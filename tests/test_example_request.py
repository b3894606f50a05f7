"""One example body, clefcore/example_request.py, for every built-in request: `clefcore demo` answers it, the
engine's self-check runs it, `clefcore verify` encodes it (tests/test_verify.py) and the server serves it to the
playground at GET /example (tests/test_server_playground.py)."""

from __future__ import annotations

import json

from clefcore import cli
from clefcore.example_request import support_ticket
from server_harness import MODEL


def test_demo_answers_the_example_request(engine, capsys):
    assert cli.main(["demo", "--model", str(MODEL)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["request"] == support_ticket()
    assert out["response"] == engine.decide(support_ticket())


def test_self_check_runs_the_example_request(engine):
    assert engine.self_check() == engine.decide(support_ticket())


def test_each_caller_gets_its_own_copy():
    """A caller that edits its copy (the OpenAPI example drops a team) leaves the next caller's as it was."""
    first = support_ticket()
    del first["questions"]["team"]["criteria"]["sales"]
    first["state"] = "changed"
    assert support_ticket()["questions"]["team"]["criteria"]["sales"] == "Plans and upgrades"
    assert support_ticket()["state"] != "changed"
