"""schemathesis against the server's own /openapi.json: schema-valid bodies are answered (and answers match
the response schemas), schema-invalid ones are refused with a documented 4xx, nothing is a 5xx.

On the Cloudflare route the body's model must also equal the model in the path, a cross-field rule JSON
Schema cannot state, so that one operation runs without the "valid data is accepted" check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from server_harness import Server  # noqa: E402

pytest.importorskip("schemathesis")


@pytest.fixture(scope="module")
def server():
    with Server() as s:
        s.wait_ready()
        yield s


def schemathesis(server: Server, *options: str) -> None:
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{server.base}/openapi.json",
           "--max-examples", "150", "--seed", "1729", "--max-failures", "5", *options]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    print(result.stdout[-3000:])
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
    assert server.proc.poll() is None


@pytest.mark.slow
def test_schemathesis_bare_routes(server):
    schemathesis(server, "--checks", "all", "--exclude-path-regex", "cloudflare")


@pytest.mark.slow
def test_schemathesis_cloudflare_route(server):
    schemathesis(server, "--checks", "all", "--exclude-checks", "positive_data_acceptance",
                 "--include-path-regex", "cloudflare")
