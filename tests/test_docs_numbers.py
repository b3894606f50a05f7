"""Every performance figure the README quotes is backed by docs/benchmarks.md or by a committed JSON.

A *figure* of the README is, outside fenced code blocks:
- a number written with one of the units ms, x (a ratio, the x against the number: 1.13x), tok/s (or tokens/s),
  TFLOP/s or GiB. In a run such as "16.8 / 71.7 / 299.6 ms" or "1.14-1.15x" every number takes the unit; a k
  after a number multiplies it by 1000 ("25.4k tok/s");
- a number in e-notation (9.0e-3) in a table row: the measured errors and contracts of the precision table.

A figure is *backed* when docs/benchmarks.md states the same number with the same unit (there, e-notation counts
anywhere), or when a JSON under docs/bench/ that the README cites in the figure's paragraph holds the number at
the figure's precision (for a table, its citations and those of the paragraph before it count; a cited folder
cites every JSON below it).
"""

from __future__ import annotations

import sys
from decimal import Decimal
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_docs import BENCHMARKS, README, Figure, figure_of, figures, unbacked  # noqa: E402


def test_every_readme_figure_is_backed():
    missing = unbacked(README.read_text(), BENCHMARKS.read_text())
    assert not missing, "README figures found neither in docs/benchmarks.md nor in a JSON cited beside them:\n" + \
        "\n".join(f"  line {f.line}: {f.text} {f.unit}" for f in missing)


def test_the_readme_quotes_figures_of_every_kind():
    units = {f.unit for f in figures(README.read_text(), e_notation_in_tables_only=True)}
    assert {"ms", "x", "GiB", "e"} <= units


def _scaled(figure: Figure, factor: str) -> str:
    """The figure's number times factor, written to the same precision."""
    if figure.unit == "e":
        mantissa, exponent = figure.text.split("e")
        digits = len(mantissa.partition(".")[2])
        return f"{Decimal(mantissa) * Decimal(factor):.{digits}f}e{exponent}"
    value = (figure.value * Decimal(factor)).quantize(figure.quantum)
    return f"{value.normalize():f}" if figure.quantum >= 1 else f"{value:f}"


def _altered(figure: Figure, stated: set) -> str:
    """The figure scaled to a number that docs/benchmarks.md does not state with its unit (a change to a figure
    that is stated elsewhere cannot be told from a quotation of that other figure)."""
    for factor in ("1.37", "1.53", "0.71", "1.91"):
        text = _scaled(figure, factor)
        if (figure_of(text, figure.unit).value, figure.unit) not in stated:
            return text
    raise AssertionError(figure)


def test_an_altered_figure_is_caught():
    """Each README figure, altered alone, is reported, and only it."""
    readme, benchmarks = README.read_text(), BENCHMARKS.read_text()
    stated = {(f.value, f.unit) for f in figures(benchmarks, e_notation_in_tables_only=False)}
    found = figures(readme, e_notation_in_tables_only=True)
    assert len(found) > 30
    for figure in found:
        changed = _altered(figure, stated)
        text = readme[:figure.start] + changed + readme[figure.start + len(figure.text):]
        reported = [(f.line, f.text) for f in unbacked(text, benchmarks)]
        assert reported == [(figure.line, changed)], (figure, reported)


def test_a_cited_json_backs_a_figure_at_its_precision():
    """wgmma's H100 bench JSON holds a 2048-token run of 70.685 ms, which docs/benchmarks.md does not quote."""
    cite = "(`docs/bench/2026-12-05-h100-wgmma-gemm/bench.json`)"
    benchmarks = BENCHMARKS.read_text()
    assert "70.69 ms" not in benchmarks
    assert unbacked(f"One run took 70.69 ms {cite}.\n", benchmarks) == []
    assert [f.text for f in unbacked(f"One run took 70.79 ms {cite}.\n", benchmarks)] == ["70.79"]
    assert [f.text for f in unbacked("One run took 70.69 ms.\n", benchmarks)] == ["70.69"]
    # a table takes the citations of the paragraph above it
    table = f"Runs {cite}:\n\n| case | time |\n|---|---|\n| 2048 tokens | 70.69 ms |\n"
    assert unbacked(table, benchmarks) == []


def test_figures_are_read_with_their_units():
    text = ("346 / 2048 tokens: 16.8 / 71.7 ms; 1.47x-1.48x; 1.14-1.15x; 16 x 512 packed; a 1024x1024 image; "
            "25.4k tok/s, 1,130 ms, 3,000 tokens/s, 0.12 GiB; 5e-5 in prose\n| mode | 9.0e-3..6.6e-3 |\n"
            "```sh\nclefcore bench  # 99 ms\n```\n")
    read = [(f.text, f.unit, f.value) for f in figures(text, e_notation_in_tables_only=True)]
    assert read == [("16.8", "ms", Decimal("16.8")), ("71.7", "ms", Decimal("71.7")),
                    ("1.47", "x", Decimal("1.47")), ("1.48", "x", Decimal("1.48")),
                    ("1.14", "x", Decimal("1.14")), ("1.15", "x", Decimal("1.15")),
                    ("25.4k", "tok/s", Decimal("25400")), ("1,130", "ms", Decimal("1130")),
                    ("3,000", "tok/s", Decimal("3000")), ("0.12", "GiB", Decimal("0.12")),
                    ("9.0e-3", "e", Decimal("0.009")), ("6.6e-3", "e", Decimal("0.0066"))]
    assert [f.text for f in figures(text, e_notation_in_tables_only=False) if f.unit == "e"] == \
        ["5e-5", "9.0e-3", "6.6e-3"]
