"""`clefcore serve --help` through the installed command: --api-key's default is named, never printed (every
command's defaults: tests/test_cli_help.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

SECRET = "s3cret-for-the-help-test"


def _help_entries(env: dict) -> dict[str, str]:
    """option -> its help entry (option, metavar and text, whitespace collapsed), from `clefcore serve --help`"""
    done = subprocess.run([sys.executable, "-m", "clefcore.cli", "serve", "--help"], capture_output=True, text=True,
                          timeout=60, cwd="/", env=env)
    assert done.returncode == 0, done.stderr
    options = done.stdout.split("\noptions:\n", 1)[1]
    entries = [" ".join(e.split()) for e in re.split(r"\n  (?=-)", "\n" + options) if e.strip()]
    return {e.split()[0].rstrip(","): e for e in entries}


def test_serve_help_does_not_print_the_api_key():
    """--api-key's default comes from $CLEFCORE_API_KEY: the help names the variable, never its value."""
    entries = _help_entries(dict(os.environ, COLUMNS="80", CLEFCORE_API_KEY=SECRET))
    assert "$CLEFCORE_API_KEY" in entries["--api-key"] and SECRET not in " ".join(entries.values())


def test_an_empty_api_key_stops_the_server_instead_of_turning_authentication_off():
    """A Secret that exists with an empty api-key must not serve without a key: serve refuses to start, naming
    the variable; an embedding program that passes an empty key to build_app gets a ValueError."""
    env = dict(os.environ, CLEFCORE_API_KEY="  ")
    done = subprocess.run([sys.executable, "-m", "clefcore.cli", "serve", "--model", "/nonexistent"],
                          capture_output=True, text=True, timeout=60, cwd="/", env=env)
    assert done.returncode == 2 and "--api-key" in done.stderr and "CLEFCORE_API_KEY" in done.stderr, done.stderr
    from clefcore.server.routes import build_app
    with pytest.raises(ValueError, match="api_key is empty"):
        build_app(None, api_key="")
    build_app(None, api_key=None)       # no key: serves without one, as before
