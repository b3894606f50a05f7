"""Reading the README and docs/*.md: the figures a text quotes, and the docs/bench/ records it names
(tests/test_docs_numbers.py says which figures count and what backs them)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from decimal import Decimal
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
BENCH = ROOT / "docs" / "bench"

_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?k?"
_START = r"(?<!\w)(?<!\d\.)(?<!\d,)"          # not inside a word or another number
_SEP = r"\s*(?:/|-|–|\.\.)\s*"
UNIT_RUN = re.compile(rf"{_START}({_NUM}(?:{_SEP}{_NUM})*)"
                      rf"(?:\s?(ms|tok/s|tokens/s|TFLOP/s|GiB)(?![\w/])|(x)(?!\w))")
ONE_NUM = re.compile(_NUM)
E_NOTATION = re.compile(rf"{_START}(\d+(?:\.\d+)?e-?\d+)(?!\w)(?!\.\d)")
CITATION = re.compile(r"docs/bench/[\w./{},*-]*")
# A record as the docs name it: docs/bench/<date>-<what>[/file], or <date>-<what>[/file] (relative to docs/bench/)
RECORD_CITATION = re.compile(r"(?:docs/bench/)?(\d{4}-\d{2}-\d{2}-[a-z0-9-]*[a-z0-9](?:/[\w.*{},-]*)?)")


@dataclass(frozen=True)
class Figure:
    text: str        # as written, e.g. "1,130" or "9.0e-3"
    value: Decimal
    quantum: Decimal  # one unit of the last digit written: the precision a JSON value is rounded to
    unit: str        # "ms", "x", "tok/s", "TFLOP/s", "GiB", or "e" for e-notation
    start: int       # offset of the number in the text it was read from
    line: int


def figure_of(text: str, unit: str, start: int = 0, source: str = "") -> Figure:
    """A figure as written: "1,130", "25.4k" (x 1000) or "9.0e-3"; source: the text it was read from."""
    k = text.endswith("k")
    digits = text.rstrip("k").replace(",", "")
    value = Decimal(digits)
    quantum = Decimal(1).scaleb(value.as_tuple().exponent)
    if k:
        value, quantum = value * 1000, quantum * 1000
    return Figure(text, value, quantum, unit, start, source.count("\n", 0, start) + 1)


def _outside_code(text: str) -> str:
    """The text with fenced code blocks blanked (offsets and line numbers kept)."""
    out, fenced = [], False
    for line in text.splitlines(keepends=True):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append(" " * (len(line) - 1) + "\n")
        else:
            out.append(re.sub(r"[^\n]", " ", line) if fenced else line)
    return "".join(out)


def figures(text: str, e_notation_in_tables_only: bool) -> list[Figure]:
    """Every figure of a markdown text, in order."""
    text = _outside_code(text)
    found = []
    for m in UNIT_RUN.finditer(text):
        unit = {"tokens/s": "tok/s"}.get(m.group(2), m.group(2)) or "x"
        for n in ONE_NUM.finditer(m.group(1)):
            found.append(figure_of(n.group(0), unit, m.start(1) + n.start(), text))
    for m in E_NOTATION.finditer(text):
        line_start = text.rfind("\n", 0, m.start()) + 1
        if not e_notation_in_tables_only or text[line_start:].lstrip().startswith("|"):
            found.append(figure_of(m.group(1), "e", m.start(1), text))
    return sorted(found, key=lambda f: f.start)


def expand_braces(path: str) -> list[str]:
    """a/{x,y}.md -> a/x.md, a/y.md"""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [p for part in m.group(1).split(",") for p in expand_braces(path[:m.start()] + part + path[m.end():])]


def cited_paths(text: str) -> list[str]:
    """The docs/bench/ paths a text names, braces expanded, trailing punctuation dropped."""
    return [p for m in CITATION.finditer(text) for p in expand_braces(m.group(0).rstrip(".,"))]


def _cited_jsons(paragraph: str) -> list[Path]:
    """The JSONs under docs/bench/ a paragraph names: a named file, every JSON of a named folder or glob."""
    found = []
    for m in RECORD_CITATION.finditer(paragraph):
        for rel in expand_braces(m.group(1).rstrip(".,")):
            for path in sorted(BENCH.glob(rel)):
                if path.is_dir():
                    found += sorted(p for p in path.rglob("*.json*") if p.suffix in (".json", ".jsonl"))
                elif path.suffix in (".json", ".jsonl"):
                    found.append(path)
    return found


def citations_by_line(text: str) -> dict[int, list[Path]]:
    """For each line number, the JSONs its paragraph cites (a table also takes the paragraph before it)."""
    lines = text.splitlines()
    paragraphs, current = [], []
    for number, line in enumerate(lines, 1):
        if line.strip():
            current.append(number)
        elif current:
            paragraphs.append(current)
            current = []
    if current:
        paragraphs.append(current)
    cited: dict[int, list[Path]] = {}
    previous: list[Path] = []
    for numbers in paragraphs:
        own = _cited_jsons("\n".join(lines[n - 1] for n in numbers))
        table = lines[numbers[0] - 1].lstrip().startswith("|")
        for n in numbers:
            cited[n] = own + (previous if table else [])
        previous = own
    return cited


def _json_numbers(value) -> list[float]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, str):
        return [float(n) for n in re.findall(r"\d+(?:\.\d+)?(?:e-?\d+)?", value)]
    items = value.values() if isinstance(value, dict) else value
    return [n for item in items for n in _json_numbers(item)]


@lru_cache(maxsize=None)
def json_numbers(path: Path) -> tuple[float, ...]:
    text = path.read_text()
    try:
        values = [json.loads(text)]
    except json.JSONDecodeError:                  # JSON lines: a value per line
        values = [json.loads(line) for line in text.splitlines() if line.strip()]
    return tuple(_json_numbers(values))


def _in_json(figure: Figure, path: Path) -> bool:
    half = float(figure.quantum) / 2 * (1 + 1e-9)
    return any(abs(n - float(figure.value)) <= half for n in json_numbers(path))


def _a_ratio_beside(figure: Figure, others: list[Figure]) -> bool:
    """An "x" figure that is the ratio of two figures of one unit written beside it (its table row or paragraph
    line), at its precision once theirs is allowed for."""
    x = float(figure.value)
    for a in others:
        for b in others:
            if a is b or a.unit != b.unit or a.unit == "x" or float(b.value) == 0:
                continue
            ratio = float(a.value) / float(b.value)
            slack = float(figure.quantum) / 2 + ratio * (float(a.quantum) / 2 / float(a.value)
                                                         + float(b.quantum) / 2 / float(b.value))
            if abs(ratio - x) <= slack * (1 + 1e-9):
                return True
    return False


def unbacked(text: str) -> list[Figure]:
    """The figures of a README or docs/ page that no JSON cited beside them holds: neither in its paragraph's
    (or, for a table, the paragraph before's) cited records, nor, for an "x", the ratio of two figures on its
    line."""
    cited = citations_by_line(text)
    found = figures(text, e_notation_in_tables_only=True)
    by_line: dict[int, list[Figure]] = {}
    for f in found:
        by_line.setdefault(f.line, []).append(f)
    out = []
    for f in found:
        if any(_in_json(f, path) for path in cited.get(f.line, [])):
            continue
        if f.unit == "x" and _a_ratio_beside(f, by_line[f.line]):
            continue
        out.append(f)
    return out
