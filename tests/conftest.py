"""Fixtures shared by several test files, and this folder on sys.path so that they import server_harness (the
importlib import mode adds no test folder)."""

import sys
from pathlib import Path

import pytest

from clefcore import switches

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def switch_registry(monkeypatch):
    """A registry of two kernel switches in place of the shipped one (which may hold none), so that the switches'
    plumbing is tested whatever ships: ``some_kernel`` (off by default) and ``other_kernel`` (on)."""
    test = (switches.Switch("some_kernel", False, "a variant not yet run on a GPU"),
            switches.Switch("other_kernel", True, "a variant both sides of which are live choices"))
    monkeypatch.setattr(switches, "SWITCHES", test)
    monkeypatch.setattr(switches, "BY_NAME", {s.name: s for s in test})
    return test


@pytest.fixture(scope="module")
def engine():
    """The tiny golden checkpoint in process on the CPU, at serve's default context: what a server's answers
    are compared with. Files that need another engine define their own."""
    import clefcore
    return clefcore.load(str(Path(__file__).parent / "golden" / "model"), device="cpu", context_length=24576)


@pytest.fixture(scope="module")
def gold_params():
    """The tiny golden checkpoint's text weights, loaded for the numpy backend."""
    from clefcore.backends.cpu import CpuOps
    from clefcore.checkpoint import Checkpoint
    from clefcore.model.params import load_params
    return load_params(Checkpoint(Path(__file__).parent / "golden" / "model"), CpuOps())
