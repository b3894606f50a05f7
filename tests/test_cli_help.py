"""Every command's --help states each option's default: the value the parser holds, as `(default: VALUE)`, or,
where that is None (worked out at start, or off), what it is in words. Flags are off unless given and required
options have none. serve's --api-key names $CLEFCORE_API_KEY, never its value."""

from __future__ import annotations

import argparse
import re

import pytest

from clefcore import cli
from clefcore.options import HelpFormatter

COMMANDS = ("decide", "demo", "synth", "verify", "bench", "serve", "loadtest", "download")


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def entries(parser: argparse.ArgumentParser) -> tuple[dict[str, str], set[str]]:
    """option -> its help entry (option, metavar and text, whitespace collapsed); and the required options (those
    outside brackets in the usage line)"""
    text = parser.format_help()
    usage, options = text.split("\noptions:\n", 1)
    found = [" ".join(e.split()) for e in re.split(r"\n  (?=-)", "\n" + options) if e.strip()]
    required = set(re.findall(r"(?<![\w-])--[\w-]+", re.sub(r"\[[^\]]*\]", "", usage)))
    return {e.split()[0].rstrip(","): e for e in found}, required


def test_every_command_is_checked():
    assert set(subparsers(cli.build_parser())) == set(COMMANDS)


def unstated(parser: argparse.ArgumentParser) -> list[str]:
    """The help entries of ``parser``'s options that do not state their default."""
    found, required = entries(parser)
    assert len(found) > 2, f"{parser.prog} lists no options (its module failed to import?): {found}"
    actions = {s: a for a in parser._actions for s in a.option_strings}
    wrong = []
    for option, entry in found.items():
        if option == "-h" or option in required:
            continue
        if actions[option].nargs == 0:                      # a flag (--no-images too): off unless given
            continue
        value = actions[option].default
        if value is None:                                   # decided later, or off: the help says which
            stated = "default" in entry and "None" not in entry
        else:
            stated = f"(default: {value})" in entry
        if not stated:
            wrong.append(entry)
    return wrong


@pytest.mark.parametrize("command", COMMANDS)
def test_help_states_each_default(command, monkeypatch):
    monkeypatch.delenv("CLEFCORE_API_KEY", raising=False)   # serve's --api-key default comes from it
    monkeypatch.setenv("COLUMNS", "1000")                   # no wrapping inside a value (argparse breaks at -)
    assert unstated(subparsers(cli.build_parser())[command]) == []


@pytest.mark.parametrize("formatter", [argparse.HelpFormatter, HelpFormatter])
def test_the_check_can_fail(formatter, monkeypatch):
    """Held defaults left out, or a None default printed or left unexplained, are caught; clefcore's formatter
    adds the held ones."""
    monkeypatch.setenv("COLUMNS", "1000")
    parser = argparse.ArgumentParser(prog="check", formatter_class=formatter)
    parser.add_argument("--rate", default=None, help="requests per second")
    parser.add_argument("--port", type=int, default=8080, help="listen port")
    parser.add_argument("--host", default="127.0.0.1", help="listen address")
    parser.add_argument("--limit", default=None, help="the most (default: %(default)s)")
    wrong = [entry.split()[0] for entry in unstated(parser)]
    assert wrong == (["--rate", "--port", "--host", "--limit"] if formatter is argparse.HelpFormatter
                     else ["--rate", "--limit"])


@pytest.mark.parametrize("command", COMMANDS)
def test_defaults_are_shown_as_written_on_the_command_line(command):
    """A default the help prints is a plain value a user could type, not a Python object's repr."""
    parser = subparsers(cli.build_parser())[command]
    shown = {a.dest: a.default for a in parser._actions
             if a.option_strings and a.nargs != 0 and a.default not in (None, argparse.SUPPRESS)}
    assert {dest: value for dest, value in shown.items() if not isinstance(value, (str, int, float))} == {}


def test_serve_help_does_not_print_the_api_key(monkeypatch):
    """--api-key's default comes from $CLEFCORE_API_KEY: the help names the variable, never its value."""
    secret = "s3cret-for-the-help-test"
    monkeypatch.setenv("CLEFCORE_API_KEY", secret)
    monkeypatch.setenv("COLUMNS", "80")
    found, _ = entries(subparsers(cli.build_parser())["serve"])
    assert "$CLEFCORE_API_KEY" in found["--api-key"] and secret not in " ".join(found.values())


@pytest.mark.parametrize("command", COMMANDS)
def test_help_is_plain_text(command, monkeypatch):
    """No reStructuredText markup or Python reprs in what a user reads."""
    monkeypatch.delenv("CLEFCORE_API_KEY", raising=False)
    text = subparsers(cli.build_parser())[command].format_help() + cli.build_parser().format_help()
    assert "``" not in text and " object at 0x" not in text and ":class:" not in text
