"""`clefcore serve --help` states every option's default: the value the parser holds, or, where that is None
because the default is worked out at start (--max-queue-wait, --age-rate, the GPU options), what it is."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from clefcore import cli

SECRET = "s3cret-for-the-help-test"


def _help_entries(env: dict) -> dict[str, str]:
    """option -> its help entry (option, metavar and text, whitespace collapsed), from `clefcore serve --help`"""
    done = subprocess.run([sys.executable, "-m", "clefcore.cli", "serve", "--help"], capture_output=True, text=True,
                          timeout=60, cwd="/", env=env)
    assert done.returncode == 0, done.stderr
    options = done.stdout.split("\noptions:\n", 1)[1]
    entries = [" ".join(e.split()) for e in re.split(r"\n  (?=-)", "\n" + options) if e.strip()]
    return {e.split()[0].rstrip(","): e for e in entries}


def test_serve_help_states_each_default(monkeypatch):
    monkeypatch.delenv("CLEFCORE_API_KEY", raising=False)
    defaults = cli.build_parser().parse_args(["serve", "--model", "m"])
    entries = _help_entries(dict(os.environ, COLUMNS="80"))
    for option in ("--port", "--host", "--device", "--max-body-bytes", "--header-timeout", "--body-timeout",
                   "--context-length"):
        value = getattr(defaults, option[2:].replace("-", "_"))
        assert value is not None and f"(default: {value})" in entries[option], entries[option]
    assert "--max-queue-wait" in entries and "--shutdown-timeout" in entries
    for option, entry in entries.items():
        if option in ("-h", "--model"):                   # help, and the one required option
            continue
        value = getattr(defaults, option[2:].replace("-", "_"))
        if value is False:                                # a flag: off unless given
            continue
        if value is None:                                 # decided at start: the help says how
            assert "default" in entry and "None" not in entry, entry
        else:
            assert re.search(rf"\(default:? {re.escape(str(value))}\b", entry), entry


def test_serve_help_does_not_print_the_api_key():
    """--api-key's default comes from $CLEFCORE_API_KEY: the help names the variable, never its value."""
    entries = _help_entries(dict(os.environ, COLUMNS="80", CLEFCORE_API_KEY=SECRET))
    assert "$CLEFCORE_API_KEY" in entries["--api-key"] and SECRET not in " ".join(entries.values())
