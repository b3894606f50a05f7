"""The precision names users can give (clefcore/precision.py): fast and exact, the kernel-path aliases, what each
resolves to, and that every command and clefcore.load accept them (and refuse anything else, or any of them on the
CPU, where they would be silently ignored)."""

from __future__ import annotations

from pathlib import Path

import pytest

import clefcore
from clefcore import cli, precision
from clefcore.errors import ClefError

MODEL = Path(__file__).parent / "golden" / "model"


@pytest.mark.parametrize("name,fp8,path", [
    ("fast", False, "fp16"), ("fast", True, "fp16"),
    ("exact", False, "split"), ("exact", True, "split8"),
    ("fp16", True, "fp16"), ("split", True, "split"), ("split8", True, "split8"), ("split8", False, "split8"),
])
def test_names_resolve_to_kernel_paths(name, fp8, path):
    assert precision.resolve(name, fp8) == path
    assert precision.mode_of(path) == ("fast" if path == "fp16" else "exact")


def test_fast_is_the_default_and_unknown_names_are_refused():
    assert precision.DEFAULT == "fast"
    with pytest.raises(ValueError, match="precision 'bf16': expected one of fast, exact, fp16, split, split8"):
        precision.resolve("bf16", True)


def test_every_verify_bound_is_a_layer_and_a_probability_bar():
    for mode in precision.MODES:
        layer, prob = precision.VERIFY_BOUND[mode]
        assert 0 < prob <= layer
    assert precision.VERIFY_BOUND["exact"][1] < precision.VERIFY_BOUND["fast"][1]


@pytest.mark.parametrize("command", ["decide", "demo", "serve", "verify", "bench"])
@pytest.mark.parametrize("name", precision.CHOICES)
def test_every_command_takes_every_name(command, name):
    extra = {"decide": ["--model", "m", "f.json"], "verify": ["--model", "m"], "demo": [], "serve": ["--model", "m"],
             "bench": []}[command]
    args = cli.build_parser().parse_args([command, "--precision", name] + extra)
    assert args.precision == name


@pytest.mark.parametrize("command", ["decide", "serve", "verify"])
def test_a_command_refuses_an_unknown_name(command, capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args([command, "--model", "m", "--precision", "bf16"] +
                                      (["f.json"] if command == "decide" else []))
    assert "invalid choice: 'bf16'" in capsys.readouterr().err


def test_bench_refuses_an_unknown_name_in_its_list():
    from clefcore import bench
    args = cli.build_parser().parse_args(["bench", "--precision", "fast,bf16"])
    with pytest.raises(ValueError, match="precision 'bf16'"):
        bench.run(args)


@pytest.mark.parametrize("name", ["fast", "exact"])
def test_load_refuses_a_precision_on_the_cpu(name):
    with pytest.raises(ClefError, match=r"precision: GPU-only options \(device is 'cpu'\)"):
        clefcore.load(MODEL, device="cpu", precision=name)


def test_the_numpy_engine_names_its_precision():
    assert clefcore.load(MODEL, device="cpu").mode == "fp32"
