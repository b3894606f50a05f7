"""docs/bench/ and docs/benchmarks.md: every record is a dated folder named by what it measures, with a README
that gives its device, commit and command; every docs/bench/ path the docs name exists; the page stays a
short description of the product's current results."""

from __future__ import annotations

import re
from pathlib import Path

from bench_docs import BENCH, BENCHMARKS, ROOT, cited_paths, expand_braces

RECORD = re.compile(r"\d{4}-\d{2}-\d{2}-[a-z0-9]+(?:-[a-z0-9]+)*")
# words about how the work was organised, which the docs leave out
ORGANISATION = re.compile(r"\b(?:issues?|sessions?|branch(?:es)?|helpers?|device calls?|device machines?)\b",
                          re.IGNORECASE)
# the same for the user's pages, where a branch of a repository or of the code is a fact of the product
WORK_WORDS = re.compile(r"\b(?:issues? \d+|sessions?|helpers?|device calls?|device machines?)\b", re.IGNORECASE)


def _records() -> list[Path]:
    return sorted(p for p in BENCH.iterdir() if p.is_dir())


def test_each_record_is_a_dated_folder_with_a_readme():
    assert len(_records()) >= 10
    for folder in _records():
        assert RECORD.fullmatch(folder.name), folder.name
        readme = (folder / "README.md").read_text()
        for field in ("Device", "Commit", "Command"):
            assert f"- {field}" in readme, (folder.name, field)


def test_only_scripts_sit_beside_the_records():
    loose = [p.name for p in BENCH.iterdir() if p.is_file()]
    assert loose and all(name.endswith((".sh", ".py")) for name in loose), loose


def test_no_record_is_named_after_how_the_work_was_organised():
    names = [str(p.relative_to(BENCH)) for p in BENCH.rglob("*")]
    assert [n for n in names if "issue" in n.lower()] == []


def test_the_benchmarks_page_is_short_and_tells_no_story_of_the_work():
    text = BENCHMARKS.read_text()
    assert len(text.splitlines()) < 300
    assert text.startswith("# Benchmarks\n")
    for path in [BENCHMARKS, *sorted(BENCH.glob("*/README.md"))]:
        assert ORGANISATION.findall(path.read_text()) == [], path


def test_every_record_is_listed_on_the_benchmarks_page():
    text = BENCHMARKS.read_text()
    assert [r.name for r in _records() if f"`{r.name}/`" not in text] == []


def test_every_named_bench_path_exists():
    """The pages a reader follows to a record or a script: the README and the docs."""
    missing = []
    for path in sorted({ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("docs/bench/**/*.md")}):
        for rel in cited_paths(path.read_text()):
            if not any(ROOT.glob(rel)):
                missing.append(f"{path.relative_to(ROOT)}: {rel}")
    assert missing == []


def test_every_record_path_on_the_page_exists():
    """benchmarks.md and the records' READMEs name records relative to docs/bench/: `<date>-<what>/file`."""
    missing = []
    for path in [BENCHMARKS, *sorted(BENCH.glob("*/README.md"))]:
        for named in re.findall(r"`(\d{4}-\d{2}-\d{2}-[^`\s]+)`", path.read_text()):
            missing += [f"{path.name}: {rel}" for rel in expand_braces(named) if not any(BENCH.glob(rel))]
    assert missing == []


def test_the_users_pages_tell_no_story_of_the_work():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "k8s" / "README.md"]
    found = {str(p.relative_to(ROOT)): WORK_WORDS.findall(p.read_text()) for p in pages}
    assert {page: words for page, words in found.items() if words} == {}
