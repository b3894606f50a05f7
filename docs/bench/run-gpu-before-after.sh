#!/usr/bin/env bash
# The whole GPU suite at an earlier commit and at this tree, on one machine in one device call: each commit's tests
# against its own package, for a change that must leave what the GPU runs as it was (the kernel choices moved into
# clefcore/kernel_select.py; since 0c148ae cuda/ differs by one comment line in vision.cu, so the compute_70 PTX
# cache, keyed by each source, needs that file's PTX for each commit). Ends within 9 min.
# Prepare here, in the repository root (.whl/ is ignored by git; carry [".whl"]):
#   .whl/new, .whl/deps and .whl/ptx70 as docs/bench/run-gpu-validate.sh's header says, then for the earlier commit C:
#   mkdir -p .whl/before/tree && git archive C | tar -x -C .whl/before/tree
#   (cd .whl/before/tree && PYENV_VERSION=3.12.1 python -m pip wheel --no-deps -w ../wheel .)
#   git diff --quiet C -- cuda/ || echo "cuda/ differs: add C's PTX to .whl/ptx70 (run the line above in its tree)"
# Run (device tool): CLEFCORE_KERNEL_CACHE=$PWD/.whl/ptx70 bash docs/bench/run-gpu-before-after.sh
# T_SUITE: each suite's limit in seconds (default 230). Writes to $OUT as it goes: device.txt, before.txt, after.txt
# (each suite's last 30 lines) and before-full.txt, after-full.txt.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-before-after-out}
mkdir -p "$OUT"
ROOT=$(pwd)
install() {   # $1: the package's wheel directory, $2: its target
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$2" "$ROOT"/.whl/deps/*.whl "$1"/clefcore-*.whl
}
install "$ROOT/.whl/before/wheel" /tmp/site-before
install "$ROOT/.whl/new" /tmp/site-after
nvidia-smi --query-gpu=name,driver_version --format=csv >"$OUT/device.txt" 2>&1
suite() {     # $1: before or after, $2: its source tree (its tests), $3: its installed package
  # `pytest`, not `python3 -m pytest`: the installed package, not the source tree (setup.cfg: --import-mode=importlib)
  (cd "$2" && PYTHONPATH="$3" PYTHONUNBUFFERED=1 timeout "${T_SUITE:-230}" pytest -q -p no:cacheprovider -m gpu tests \
    2>&1 | tee "$OUT/$1-full.txt" | tail -30 >"$OUT/$1.txt")
}
suite before "$ROOT/.whl/before/tree" /tmp/site-before
suite after "$ROOT" /tmp/site-after
