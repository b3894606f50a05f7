"""The import contracts in setup.cfg ([importlinter]: layers, no cycles, independent commands), checked by
import-linter's `lint-imports` against the installed package, where server/ is clefcore.server."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter", reason="import-linter is not installed (pip install clefcore[test])")

CONFIG = Path(__file__).resolve().parent.parent / "setup.cfg"
LINT = shutil.which("lint-imports") or pytest.skip("import-linter's lint-imports is not on PATH",
                                                   allow_module_level=True)


def _installed_package(cwd: Path) -> Path:
    """The directory `clefcore` is imported from, as lint-imports finds it (a fresh interpreter in ``cwd``)."""
    found = subprocess.run(
        [sys.executable, "-c", "import importlib.util; print(*importlib.util.find_spec('clefcore')"
                               ".submodule_search_locations, sep='\\n')"],
        cwd=cwd, capture_output=True, text=True, check=True).stdout.split("\n")[0]
    package = Path(found)
    if not (package / "server" / "__init__.py").is_file():
        # meson-python's editable loader maps names to files itself: the package has no directory to walk
        pytest.skip(f"clefcore is not installed as files (an editable install? found {found!r}); "
                    "lint-imports needs a regular install, as .ci/run makes")
    return package


def _lint(cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([LINT, str(CONFIG)], cwd=cwd, capture_output=True, text=True, env=env)


def test_installed_package_keeps_every_import_contract(tmp_path):
    _installed_package(tmp_path)
    result = _lint(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_a_new_cycle_breaks_the_contracts(tmp_path):
    """The check can fail: a copy of the installed package with workers importing main back (the cycle this
    layout removed) is refused."""
    copy = tmp_path / "site" / "clefcore"
    shutil.copytree(_installed_package(tmp_path), copy, ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / "server" / "workers.py", "a") as f:
        f.write("\nfrom . import main  # noqa: E402,F401\n")
    result = _lint(tmp_path, env=dict(os.environ, PYTHONPATH=str(copy.parent)))
    assert result.returncode != 0
    assert "no import cycles between sibling modules, at any depth BROKEN" in " ".join(result.stdout.split())
