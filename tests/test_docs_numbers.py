"""Every measured figure the README and docs/ quote is backed by a committed JSON under docs/bench/, named beside it.

A *figure* is, outside fenced code blocks:
- a number written with one of the units ms, x (a ratio, the x against the number: 1.13x), tok/s (or tokens/s),
  TFLOP/s or GiB. In a run such as "16.8 / 71.7 / 299.6 ms" or "1.14-1.15x" every number takes the unit; a k
  after a number multiplies it by 1000 ("25.4k tok/s");
- a number in e-notation (9.0e-3) in a table row: the measured errors of the precision tables.

A figure is *backed* when a JSON under docs/bench/ that its paragraph names holds the number at the figure's
precision. A record is named as `docs/bench/<date>-<what>/<file>` or, in docs/, as `<date>-<what>/<file>`; a
folder names every JSON below it; a table also takes the names of the paragraph before it. A ratio is backed too
when it is the ratio of two figures on its own line (a table row). Each record's README gives its device and
commit (tests/test_bench_records.py), so a backed figure names both.

Figures that are settings, limits, contracts or sizes worked out from shapes rather than measurements are
listed in SETTINGS with the line that holds them. NOT_RECORDED lists the measured figures that have no
committed record yet, so that the gap stays in sight.
"""

from __future__ import annotations

import re
from decimal import Decimal
from pathlib import Path

import pytest

from bench_docs import DOCS, ROOT, Figure, figure_of, figures, unbacked

# (page, a snippet of the line, the figures on it that are not measurements): why
SETTINGS = {
    ("operations.md", "within 2x of this one's size", ("2",)): "admission's body-size window, a setting",
    ("operations.md", "or 4x its expected time", ("4",)): "the stall limit, a setting (--stall-timeout's rule)",
    ("operations.md", "within 1e-2 of the fp32 reference", ("1e-2", "2e-4")): "the precision modes' contracts",
    ("operations.md", "15.2 GiB left to the server", ("15.2",)): "the memory the experiment left, its setting",
    ("operations.md", "**Pod resources**", ("8", "32")): "the pod's resources, a setting",
    ("operations.md", "start value of its device kind", ("2,000",)): "the rate assumed before one is measured",
    ("operations.md", "woke a 20 ms timer", ("20",)): "the event-loop probe's period, a setting",
    ("kernels.md", "| `fast` (default) |", ("1e-2",)): "fast's contract",
    ("kernels.md", "| `exact` |", ("2e-4",)): "exact's contract",
    ("benchmarks.md", "memory but 15.2 GiB (15.78 GiB less", ("15.2", "15.78")):
        "the memory the experiment left, its setting",
    ("benchmarks.md", "429 p99 <= 50 ms", ("50",)): "a target of the overload behaviours",
    ("sm70-design.md", "twins that would leave under 2 GiB", ("2",)): "split8's free-memory floor, a setting",
    ("sm70-design.md", "x [T, 4096] stays whole (0.375 GiB at", ("0.375",)):
        "the residual stream's size at 24,576 tokens (24,576 x 4096 fp32)",
    ("sm70-design.md", "The largest live set: x (0.375 GiB)", ("0.375", "0.09", "0.6")):
        "sizes worked out from the shapes: the residual stream, the K/V cache, one block's buffers",
    ("sm70-design.md", "What a 15.2 GiB card can hold", ("15.2",)):
        "the memory the experiment left, its setting",
}
# (page, a snippet of the line, figures): measured, but by a run whose output was not committed
NOT_RECORDED = {
    ("operations.md", "short p50 1,115 ms and long p50 1,800 ms", ("1,115", "1,800")),
    ("operations.md", "(0.62x), 244 of 272 short attempts", ("0.62", "9k")),
    ("operations.md", "short p50 365 ms, p99 744 ms", ("365", "744", "1,986")),
    ("operations.md", "1.5 M characters, ~0.55 GiB at peak on the CPU", ("0.55",)),
    ("operations.md", "`/live` answered within 93 ms meanwhile", ("93",)),
}


def _excused(page: Path) -> dict[str, set[str]]:
    """snippet -> the figures it excuses on ``page``."""
    return {snippet: set(texts) for (name, snippet, texts) in [*SETTINGS, *NOT_RECORDED] if name == page.name}


def unbacked_on(page: Path, text: str | None = None) -> list[Figure]:
    text = page.read_text() if text is None else text
    excused = _excused(page)
    lines = text.splitlines()
    return [f for f in unbacked(text)
            if not any(snippet in lines[f.line - 1] and f.text in texts for snippet, texts in excused.items())]


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_figure_is_backed_by_a_record(page):
    missing = unbacked_on(page)
    assert not missing, f"{page.name}: figures no JSON cited beside them holds:\n" + \
        "\n".join(f"  line {f.line}: {f.text} {f.unit}" for f in missing)


def test_every_excuse_still_applies():
    """A setting or an unrecorded figure that the page no longer has is dropped from the lists."""
    pages = {p.name: p.read_text() for p in DOCS}
    for name, snippet, texts in [*SETTINGS, *NOT_RECORDED]:
        lines = [line for line in pages[name].splitlines() if snippet in line]
        assert texts and any(all(re.search(rf"(?<![\d.,]){re.escape(t)}(?![\d])", line) for t in texts)
                             for line in lines), (name, snippet)


def test_the_docs_quote_figures_of_every_kind():
    units = {f.unit for page in DOCS for f in figures(page.read_text(), e_notation_in_tables_only=True)}
    assert {"ms", "x", "GiB", "e", "tok/s", "TFLOP/s"} <= units


def _scaled(figure: Figure, factor: str) -> str:
    """The figure's number times factor, written to the same precision."""
    if figure.unit == "e":
        mantissa, exponent = figure.text.split("e")
        digits = len(mantissa.partition(".")[2])
        return f"{Decimal(mantissa) * Decimal(factor):.{digits}f}e{exponent}"
    value = (figure.value * Decimal(factor)).quantize(figure.quantum)
    text = f"{value.normalize():f}" if figure.quantum >= 1 else f"{value:f}"
    return f"{int(text):,}" if "," in figure.text else text


def test_an_altered_figure_is_caught():
    """Each backed figure of benchmarks.md, altered alone, is reported (with the ratios on its line that it
    backed), or, rarely, matches another number of a cited JSON by chance: at most a tenth of them."""
    page = ROOT / "docs" / "benchmarks.md"
    text = page.read_text()
    found = [f for f in figures(text, e_notation_in_tables_only=True) if f not in unbacked(text)]   # by a JSON
    assert len(found) > 100
    caught = 0
    for figure in found:
        changed = _scaled(figure, "1.37")
        altered = text[:figure.start] + changed + text[figure.start + len(figure.text):]
        reported = unbacked_on(page, altered)
        itself = [f for f in reported if (f.line, f.text) == (figure.line, changed)]
        ratios = [f for f in reported if f.line == figure.line and f.unit == "x" and f not in itself]
        assert len(itself) + len(ratios) == len(reported), (figure, reported)
        caught += bool(itself)
    assert caught >= 0.9 * len(found), (caught, len(found))


def test_a_cited_json_backs_a_figure_at_its_precision():
    """wgmma's H100 bench JSON holds a 2048-token run of 70.685 ms."""
    for cite in ("(`docs/bench/2026-12-05-h100-wgmma-gemm/bench.json`)", "(`2026-12-05-h100-wgmma-gemm/bench.json`)",
                 "(`2026-12-05-h100-wgmma-gemm/`)"):
        assert unbacked(f"One run took 70.69 ms {cite}.\n") == []
        assert [f.text for f in unbacked(f"One run took 70.79 ms {cite}.\n")] == ["70.79"]
    assert [f.text for f in unbacked("One run took 70.69 ms.\n")] == ["70.69"]
    # a table takes the citations of the paragraph above it, and not of one further up
    cite = "(`2026-12-05-h100-wgmma-gemm/bench.json`)"
    table = "| case | time |\n|---|---|\n| 2048 tokens | 70.69 ms |\n"
    assert unbacked(f"Runs {cite}:\n\n{table}") == []
    assert [f.text for f in unbacked(f"Runs {cite}:\n\nOther words.\n\n{table}")] == ["70.69"]


def test_a_ratio_is_backed_by_the_figures_beside_it():
    row = "| 2048 tokens | 70.9 ms | 81.8 ms | {} |\n"
    assert unbacked(row.format("1.15x")) == [f for f in unbacked(row.format("1.15x")) if f.unit != "x"]
    assert [f.text for f in unbacked(row.format("1.25x")) if f.unit == "x"] == ["1.25"]


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
    assert figure_of("25.4k", "tok/s").quantum == 100


def test_the_kernel_switches_table_follows_switches_py():
    from clefcore.switches import SWITCHES
    text = (ROOT / "docs" / "kernels.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| (on|off) \|", text, re.M))
    assert rows == {s.name: "on" if s.default else "off" for s in SWITCHES}


def test_the_readme_is_short_and_starts_with_its_reader():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 200
    first = text.split("\n\n")[1]
    assert "for teams" in first and "Clef-flash" in first
    for word in ("System One", "`noul`", "`choice`", "`score`", "X-Api-Key", "python3 -m venv"):
        assert word in text, word
    # the two commands
    assert "pip install . && clefcore demo" in text and "bash .ci/run" in text
