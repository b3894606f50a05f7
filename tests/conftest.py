"""Fixtures shared by several test files."""

import pytest

from clefcore import switches


@pytest.fixture
def switch_registry(monkeypatch):
    """A registry of two kernel switches in place of the shipped one (which may hold none), so that the switches'
    plumbing is tested whatever ships: ``some_kernel`` (off by default) and ``other_kernel`` (on)."""
    test = (switches.Switch("some_kernel", False, "a variant not yet run on a GPU"),
            switches.Switch("other_kernel", True, "a variant both sides of which are live choices"))
    monkeypatch.setattr(switches, "SWITCHES", test)
    monkeypatch.setattr(switches, "BY_NAME", {s.name: s for s in test})
    return test
