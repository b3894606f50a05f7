#!/usr/bin/env bash
# A GPU check in one device call: the GPU suite on this tree, then `clefcore bench` on the tree before the
# backend interface and the bench package (a89917a) and on this one: same GPU, same call.
#
# Prepare once, on the development machine, in the repository root (.whl/ is ignored by git; carry [".whl"]):
#   py=python3.12   # the device's python3 is 3.12 and has no meson-python
#   git worktree add --detach /tmp/base-a89917a a89917a && $py -m pip wheel --no-deps -w .whl/base /tmp/base-a89917a
#   $py -m pip wheel --no-deps -w .whl/new .
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl/deps prometheus_client Brotli backports.zstd uvloop ml_dtypes Pillow
# Run (device tool, repository root as cwd): bash docs/bench/run-gpu-check.sh
# Writes to $OUT: gpu-suite.txt (pytest's summary), bench-base.json, bench-new.json, bench.txt (both tables).
# STEPS picks the parts ("suite bench", the default). The suite took ~110 s on the H200 at 167466d; each bench
# run (fast, kernels, 346 to 24,576 tokens, packed, no transformers) is a few minutes: if the two do not fit one
# 10-minute call, run STEPS=suite and STEPS=bench in two calls on the same warm machine.
#
# Bench's random weights follow synth's rules since 838ab31 (the base's bench drew its own), so the end-to-end
# times compare like for like only where the weights do not matter to the kernels' speed: fast mode's guard
# fallbacks are counted in both JSONs; compare those first.
set -euo pipefail
OUT=${OUT:-/tmp/gpu-check-out}
STEPS=${STEPS:-"suite bench"}
BENCH_ARGS=${BENCH_ARGS:-"--precision fast --no-transformers"}
mkdir -p "$OUT"
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-deps "$ROOT"/.whl/deps/*.whl
for tree in new base; do
  rm -rf "/tmp/site-$tree"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "/tmp/site-$tree" "$ROOT"/.whl/"$tree"/clefcore-*.whl
done

if [[ " $STEPS " == *" suite "* ]]; then
  # the tests import the installed package: `pytest`, not `python3 -m pytest`, so that the source tree's clefcore/
  # does not shadow it (setup.cfg sets --import-mode=importlib)
  PYTHONPATH=/tmp/site-new:/tmp/site-deps pytest -q -p no:cacheprovider -m gpu tests 2>&1 \
    | tail -40 >"$OUT/gpu-suite.txt" || true
  PYTHONPATH=tests/no_cublas:/tmp/site-new:/tmp/site-deps pytest -q -p no:cacheprovider -m gpu \
    tests/test_kernels.py tests/test_bench.py 2>&1 | tail -15 >>"$OUT/gpu-suite.txt" || true
fi

if [[ " $STEPS " == *" bench "* ]]; then
  cd /tmp   # never import the source tree
  for tree in base new; do
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
    PYTHONPATH=/tmp/site-$tree:/tmp/site-deps python3 -m clefcore.cli bench $BENCH_ARGS \
      --json "$OUT/bench-$tree.json" 2>&1 | sed "s/^/$tree: /" >>"$OUT/bench.txt"
  done
fi
