"""EngineOptions (clefcore/options.py): one definition of the engine's options, their defaults, their checks and
their flags, used by every command that loads an engine, by ServiceConfig and by clefcore.load."""

import pickle
import re
from pathlib import Path

import pytest

import clefcore
from clefcore import cli, gpu_settings, precision
from clefcore.device import Device
from clefcore.errors import ClefError
from clefcore.options import DEFAULT_CONTEXT_LENGTH, SERVE_CONTEXT_LENGTH, EngineOptions, ServiceConfig

MODEL = Path(__file__).parent / "golden" / "model"
COMMANDS = {"decide": ["f.json"], "demo": [], "serve": ["--model", "m"], "verify": ["--model", "m"], "bench": []}


def parse(command: str, *flags: str):
    extra = COMMANDS[command]
    if command == "decide":
        extra = ["--model", "m"] + extra
    return cli.build_parser().parse_args([command, *flags, *extra])


@pytest.mark.parametrize("field, value, limit", [
    ("context_length", 0, "> 0"), ("validation", "strict", "one of cloudflare, reference"),
    ("confidence", "max", "one of cloudflare, reference, typesafe"), ("regex", "gpt2", "one of qwen2, qwen35 or None"),
    ("precision", "bf16", "one of fast, exact, fp16, split, split8 or None"),
    ("gemm", "cutlass", "one of auto, wmma, cublas or None"), ("token_block", -1, ">= 0 or None"),
    ("graph_tokens", -5, ">= 0 or None")])
def test_a_bad_value_names_the_field_and_the_limit(field, value, limit):
    with pytest.raises(ValueError, match=f"^{field} must be {limit}, got"):
        EngineOptions(**{field: value})


def test_gpu_holds_only_the_gpu_options_given():
    assert EngineOptions(context_length=10, images=False).gpu() == {}
    assert EngineOptions(gemm="wmma", token_block=0).gpu() == {"gemm": "wmma", "token_block": 0}
    assert EngineOptions(ptx70=True).gpu() == {"ptx70": True}


@pytest.mark.usefixtures("switch_registry")
def test_it_crosses_a_pipe_as_it_is():
    options = EngineOptions(context_length=77, regex="qwen2", precision="exact", kernels="some_kernel")
    assert pickle.loads(pickle.dumps(options)) == options


@pytest.mark.parametrize("command, default", [("decide", DEFAULT_CONTEXT_LENGTH), ("demo", DEFAULT_CONTEXT_LENGTH),
                                              ("serve", SERVE_CONTEXT_LENGTH)])
@pytest.mark.usefixtures("switch_registry")
def test_commands_that_answer_build_it_from_their_flags(command, default, capsys):
    assert EngineOptions.from_args(parse(command)) == EngineOptions(context_length=default)
    flags = ["--context-length", "900", "--validation", "reference", "--confidence", "reference", "--regex",
             "qwen35", "--no-images", "--precision", "exact", "--gemm", "cublas", "--token-block", "64",
             "--graph-tokens", "0", "--kernels", "some_kernel", "--ptx70"]
    assert EngineOptions.from_args(parse(command, *flags)) == EngineOptions(
        900, "reference", "reference", "qwen35", False, "exact", "cublas", 64, 0, "some_kernel", True)
    assert capsys.readouterr().err == ""
    # --max-length, --context-length's old name: the same option, with one line on stderr saying so
    assert EngineOptions.from_args(parse(command, "--max-length", "33")).context_length == 33
    assert capsys.readouterr().err == (f"clefcore {command}: warning: --max-length is deprecated, "
                                       f"use --context-length\n")
    with pytest.raises(SystemExit):
        parse(command, "--max-length", "0")
    assert "must be > 0" in capsys.readouterr().err


def test_serve_nests_it_in_the_service_config():
    config = ServiceConfig.from_args(parse("serve", "--context-length", "512", "--gemm", "wmma"))
    assert config.engine == EngineOptions(context_length=512, gemm="wmma")
    assert ServiceConfig(model="m").engine.context_length == SERVE_CONTEXT_LENGTH


@pytest.mark.usefixtures("switch_registry")
def test_verify_and_bench_take_its_gpu_flags():
    verify = EngineOptions.from_args(parse("verify", "--precision", "exact", "--gemm", "wmma", "--no-images",
                                           "--kernels", "some_kernel", "--token-block", "128"))
    assert verify == EngineOptions(images=False, precision="exact", gemm="wmma", kernels="some_kernel",
                                   token_block=128)
    bench = parse("bench", "--precision", "fast,exact", "--gemm", "cublas", "--graph-tokens", "0")
    assert bench.precisions == "fast,exact"       # bench's own list, not EngineOptions' field
    assert EngineOptions.from_args(bench) == EngineOptions(gemm="cublas", graph_tokens=0)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_the_choices_are_defined_once(command):
    actions = {a.dest: a for a in cli.build_parser()._subparsers._group_actions[0].choices[command]._actions}
    assert actions["gemm"].choices is gpu_settings.GEMM_CHOICES
    if command != "bench":
        assert actions["precision"].choices is precision.CHOICES


@pytest.mark.parametrize("flag", ["--token-block", "--graph-tokens"])
def test_negative_gpu_sizes_are_refused_at_parse_time(flag, capsys):
    with pytest.raises(SystemExit):
        parse("decide", flag, "-1")
    assert "must be >= 0" in capsys.readouterr().err


def test_load_maps_keywords_onto_the_options():
    engine = clefcore.load(MODEL, "cpu", EngineOptions(context_length=300, validation="reference"),
                           confidence="reference")
    assert engine.options == EngineOptions(300, "reference", "reference")
    assert engine.host.context_length == 300 and engine.confidence == "reference"
    with pytest.warns(DeprecationWarning, match=r"^load\(max_length=\) is deprecated, use context_length=$"):
        assert clefcore.load(MODEL, max_length=600).host.context_length == 600     # the old name
    with pytest.raises(ClefError, match=r"^gemm: GPU-only options \(device is 'cpu'\)$"):
        clefcore.load(MODEL, "cpu", EngineOptions(gemm="auto"))
    with pytest.raises(TypeError):
        clefcore.load(MODEL, colour="blue")


def test_a_device_is_cpu_cuda_or_cuda_n():
    """One parse for every --device (load, verify, bench, the server's device processes); anything else is
    refused naming the field and the forms it takes, before a backend is made."""
    assert [Device.parse(d) for d in ("cpu", "cuda", "cuda:0", "cuda:3")] == [
        Device("cpu"), Device("cuda", 0), Device("cuda", 0), Device("cuda", 3)]
    for bad in ("gpu", "CPU", "cuda:", "cuda:x", "cuda:-1", "cuda:1:2", " cuda:1", "cuda:\u0661", "cpu:0"):
        with pytest.raises(ClefError, match=r"^device must be cpu, cuda or cuda:N \(N a GPU index, 0 or more\), "
                                            rf"got {re.escape(repr(bad))}$"):
            Device.parse(bad)
    with pytest.raises(ClefError, match="^device must be"):
        clefcore.load(MODEL, "cuda:x")
