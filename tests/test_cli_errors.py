"""A user's mistakes through the installed command: one line on stderr that says what is wrong, exit status 1,
no traceback (``clefcore --debug`` keeps it); an empty API key; ``clefcore --version``. The download's
unreachable Hub: tests/test_download.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import clefcore

MODEL = Path(__file__).parent / "golden" / "model"


def clefcore_cli(*args: str, timeout: float = 120, api_key: str | None = None
                 ) -> subprocess.CompletedProcess:
    """The installed command, with $CLEFCORE_API_KEY only where ``api_key`` is given."""
    env = {k: v for k, v in os.environ.items() if k != "CLEFCORE_API_KEY"}
    if api_key is not None:
        env["CLEFCORE_API_KEY"] = api_key
    return subprocess.run([sys.executable, "-m", "clefcore.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd="/", env=env)


def one_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_version():
    done = clefcore_cli("--version")
    assert done.returncode == 0 and done.stdout == f"clefcore {clefcore.__version__}\n"


@pytest.mark.parametrize("args, message", [
    (("decide", "--model", str(MODEL), "{tmp}/no.json"), "decide: {tmp}/no.json: No such file or directory"),
    (("decide", "--model", str(MODEL), "{tmp}"), "decide: {tmp}: Is a directory"),
    (("demo", "--model", "{tmp}/clef-flash"),
     "demo: {tmp}/clef-flash: model directory not found (nor is it a Hub id, owner/name)"),
], ids=["missing-request", "directory-request", "wrong-model"])
def test_a_wrong_path(tmp_path, args, message):
    line = one_line(clefcore_cli(*(a.format(tmp=tmp_path) for a in args)))
    assert line == "clefcore " + message.format(tmp=tmp_path)


def test_serving_a_wrong_model_path(tmp_path):
    """serve listens at once and loads meanwhile: its JSON log (stderr) says load_failed, and its last line is
    the user's, in words."""
    done = clefcore_cli("serve", "--model", str(tmp_path / "clef-flash"), "--port", "0")
    assert done.returncode == 1 and "Traceback" not in done.stderr and done.stdout == ""
    *log, last = done.stderr.splitlines()
    assert last == (f"clefcore serve: {tmp_path / 'clef-flash'}: model directory not found "
                    "(nor is it a Hub id, owner/name)")
    assert [json.loads(line)["event"] for line in log] == ["listening", "load_failed", "exit"]


def test_debug_keeps_the_traceback(tmp_path):
    done = clefcore_cli("--debug", "decide", "--model", str(MODEL), str(tmp_path / "nope.json"))
    assert done.returncode == 1 and "Traceback" in done.stderr and "FileNotFoundError" in done.stderr


def test_serving_on_a_busy_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = one_line(clefcore_cli("serve", "--model", str(MODEL), "--host", "127.0.0.1", "--port", str(port)))
    assert line == (f"clefcore serve: port {port} on 127.0.0.1 is already in use: stop what listens there, or "
                    "choose another with --port")


def test_an_empty_api_key_stops_the_server_instead_of_turning_authentication_off():
    """A Secret that exists with an empty api-key must not serve without a key: serve refuses to start, naming
    the variable; an embedding program that passes an empty key to build_app gets a ValueError."""
    done = clefcore_cli("serve", "--model", "/nonexistent", timeout=60, api_key="  ")
    assert done.returncode == 2, done.stderr
    assert "--api-key" in done.stderr and "CLEFCORE_API_KEY" in done.stderr, done.stderr
    from clefcore.server.routes import build_app
    with pytest.raises(ValueError, match="api_key is empty"):
        build_app(None, api_key="")
    build_app(None, api_key=None)       # no key: serves without one, as before
