"""The precision names (clefcore/precision.py): what each resolves to, every command and clefcore.load
accepting them (refused on the CPU), and the precision table's rows."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

import clefcore
from clefcore import cli, precision
from clefcore.errors import ClefError
from clefcore.precision import FP32, TABLE, GemmOperands, Plan

MODEL = Path(__file__).parent / "golden" / "model"
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name,fp8,path", [
    ("fast", False, "fp16"), ("fast", True, "fp16"),
    ("exact", False, "split"), ("exact", True, "split8"),
    ("fp16", True, "fp16"), ("split", True, "split"), ("split8", True, "split8"), ("split8", False, "split8"),
])
def test_names_resolve_to_kernel_paths(name, fp8, path):
    assert precision.resolve(name, fp8) == path
    assert Plan(path).row.mode == ("fast" if path == "fp16" else "exact")


def test_fast_is_the_default_and_unknown_names_are_refused():
    assert precision.DEFAULT == "fast"
    with pytest.raises(ValueError, match="precision 'bf16': expected one of fast, exact, fp16, split, split8"):
        precision.resolve("bf16", True)


def test_every_verify_bound_is_a_layer_and_a_probability_bar():
    for mode in precision.MODES:
        layer, prob = precision.VERIFY_BOUND[mode]
        assert 0 < prob <= layer
    assert precision.VERIFY_BOUND["exact"][1] < precision.VERIFY_BOUND["fast"][1]


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


# ------------------------------------------------------------------------------------------------ the table

def test_the_table_has_a_row_for_every_path_and_every_mode():
    """One row per kernel path and numpy's fp32, nothing else; each mode's paths (with and without fp8) are rows
    of that mode, and every name a user may give resolves to a row."""
    assert set(TABLE) == set(precision.KERNEL_PATHS) | {FP32}
    for mode in precision.MODES:
        for fp8 in (False, True):
            assert TABLE[precision.resolve(mode, fp8)].mode == mode
    assert {TABLE[precision.resolve(name, fp8)].mode for name in precision.CHOICES for fp8 in (False, True)} \
        == set(precision.MODES)
    assert TABLE[FP32].mode == FP32 and precision.VERIFY_BOUND.keys() == set(precision.MODES)


@pytest.mark.parametrize("path", ["bf16", "fast", "exact", "", "FP16"])
def test_an_unknown_kernel_path_is_refused_naming_the_paths(path):
    """A mode's name is not a path either: a Plan holds what a name resolved to."""
    with pytest.raises(ValueError, match=rf"kernel path {path!r}: expected one of fp16, split, split8, fp32$"):
        Plan(path)
    with pytest.raises(ValueError, match="expected one of"):
        replace(Plan("fp16"), path=path)


# what each op family runs per path: (GEMM operands: rounded once to fp16, split hi + lo, lo in fp8;
# delta-rule module, passes; vision attention on the fp16 kernel; tower graphs)
FAMILIES = {
    "fp16": ((True, False, False), ("gated_delta_wy_fast.cu", 1), True, True),
    "split": ((False, True, False), ("gated_delta_wy.cu", 3), False, False),
    "split8": ((False, True, True), ("gated_delta_wy.cu", 3), False, False),
    FP32: ((False, False, False), (None, 0), False, False),
}


@pytest.mark.parametrize("path", list(FAMILIES))
def test_each_op_familys_row(path):
    gemm, rule, attention_fp16, tower_graphs = FAMILIES[path]
    row = Plan(path).row
    assert (row.gemm.fp16, row.gemm.split, row.gemm.fp8_lo) == gemm
    assert (row.delta_rule.module, row.delta_rule.passes) == rule
    assert row.attention_fp16 is attention_fp16 and row.tower_graphs is tower_graphs
    # the range-safe fallback keeps its path's row: only the scaling differs
    assert Plan(path, range_safe=True).row == row and Plan(path, range_safe=True) != Plan(path)


def test_the_rows_are_consistent():
    """The GEMM operand kinds exclude each other; the tower replays graphs only where its attention is the fp16
    kernel (the fp32 one calls CuPy's matmul, which refuses a capture); every delta-rule module is a kernel
    source; the fallback's plan is split's row, range-safe, without fp8."""
    for path, row in TABLE.items():
        assert sum((row.gemm.fp16, row.gemm.split, row.gemm is GemmOperands.FP32)) == 1, path
        assert row.gemm.split or not row.gemm.fp8_lo, path
        assert row.attention_fp16 or not row.tower_graphs, path
        if row.delta_rule.module is not None:
            assert (ROOT / "cuda" / row.delta_rule.module).is_file(), path
    safe = precision.RANGE_SAFE
    assert safe.range_safe and safe.row == TABLE["split"] and not safe.row.gemm.fp8_lo
