"""The kernel switches (clefcore/switches.py): option, environment, default in that order; bad names refused;
every engine-loading command takes --kernels."""

import argparse

import pytest

from clefcore import switches
from clefcore.options import EngineOptions, ServiceConfig

NAME, ENV = "some_kernel", "CLEFCORE_SOME_KERNEL"
pytestmark = pytest.mark.usefixtures("switch_registry")


def _on(spec, environ) -> set[str]:
    """The names of the switches resolve turns on (it gives the registry's Switch objects)."""
    on = switches.resolve(spec, environ=environ)
    assert all(s is switches.BY_NAME[s.name] for s in on)
    return {s.name for s in on}


def test_defaults_env_and_option_in_order():
    assert _on(None, {}) == {"other_kernel"}
    assert _on("other_kernel=off", {}) == set()
    assert NAME in _on(None, {ENV: "1"})
    assert NAME not in _on(None, {ENV: "off"})
    assert NAME in _on(NAME, {ENV: "0"})               # the option beats the environment
    assert NAME not in _on(f"{NAME}=off", {ENV: "1"})
    # the Switch objects, never names: a choice asks ``CONSTANT in on``, so a misspelt constant is an AttributeError
    on = switches.resolve(NAME, environ={})
    assert on == set(switches.BY_NAME.values()) and NAME not in on


def test_every_switch_has_an_env_name_and_help():
    assert len({s.env for s in switches.SWITCHES}) == len(switches.SWITCHES)
    for s in switches.SWITCHES:
        assert s.env == "CLEFCORE_" + s.name.upper() and s.help
        assert s.name in switches.describe()


@pytest.mark.parametrize("spec,words", [("nope", ["unknown switch 'nope'", NAME]),
                                        (f"{NAME}=maybe", ["'maybe' is not on or off"])])
def test_bad_specs_name_the_choices(spec, words):
    with pytest.raises(ValueError) as e:
        switches.parse(spec)
    for w in words:
        assert w in str(e.value)


def test_bad_environment_value_names_the_variable():
    with pytest.raises(ValueError, match=ENV):
        switches.resolve(None, environ={ENV: "sometimes"})


def test_flag_reaches_load_options_and_is_checked_at_parse_time():
    p = argparse.ArgumentParser()
    EngineOptions().add_flags(p, EngineOptions.GPU)
    assert EngineOptions.from_args(p.parse_args(["--kernels", NAME])).gpu()["kernels"] == NAME
    assert "kernels" not in EngineOptions.from_args(p.parse_args([])).gpu()
    with pytest.raises(SystemExit):
        p.parse_args(["--kernels", "nope"])


def test_service_config_refuses_an_unknown_switch():
    assert ServiceConfig(model="m", engine=EngineOptions(kernels=NAME)).engine.kernels == NAME
    with pytest.raises(ValueError, match="unknown switch 'nope'"):
        ServiceConfig(model="m", engine=EngineOptions(kernels="nope"))


def test_an_empty_registry_refuses_every_name(monkeypatch):
    monkeypatch.setattr(switches, "SWITCHES", ())
    monkeypatch.setattr(switches, "BY_NAME", {})
    assert switches.resolve(None, environ={ENV: "1"}) == frozenset() and switches.describe() == "none at present"
    with pytest.raises(ValueError, match="unknown switch"):
        switches.parse(NAME)
