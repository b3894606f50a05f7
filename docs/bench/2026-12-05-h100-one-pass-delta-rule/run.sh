#!/usr/bin/env bash
# The one-pass fast delta rule on a GPU, in one device call: its kernel tests and the golden engine tests in
# every mode (native and compute_70 PTX), then `clefcore bench` (fast; kernels table, 2048 and 8192 tokens,
# 16 x 512) on the tree with three passes (.whl/main) and on the tree with one (.whl/gdn, in c25c249 since), same
# GPU, same call. The figures beside this script (H100, 2026-12-05) came from these steps, run in two calls:
# .whl/main held 8593dda.
#
# Prepare on the development machine, in the one-pass tree's root (.whl/ is ignored by git; carry [".whl"]):
#   py=python3.12   # the device's python3 is 3.12 and has no meson-python
#   $py -m pip wheel --no-deps -w .whl/gdn . && git worktree add --detach /tmp/main-tree main && \
#     $py -m pip wheel --no-deps -w .whl/main /tmp/main-tree
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl/deps prometheus_client Brotli backports.zstd uvloop ml_dtypes Pillow
#   CLEFCORE_KERNEL_CACHE=.whl/ptx70: the compute_70 PTX of every kernel file (clefcore.backends.cuda.compile
#     .ptx70_path for each of kernel_files()), made here with the pip NVRTC 12 (the device has none for sm_70)
# Run: CLEFCORE_KERNEL_CACHE=$PWD/.whl/ptx70 bash docs/bench/2026-12-05-h100-one-pass-delta-rule/run.sh
# Writes to $OUT: gdn-suite.txt, bench-main.json, bench-gdn.json, bench-gdn.txt. The one-pass tree is the better
# one only if the suite passes and the delta rule's kernel row is faster.
set -uo pipefail
OUT=${OUT:-/tmp/gdn-check-out}
mkdir -p "$OUT"
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-deps "$ROOT"/.whl/deps/*.whl
for t in main gdn; do
  rm -rf "/tmp/site-$t"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "/tmp/site-$t" "$ROOT"/.whl/$t/clefcore-*.whl
done
# `pytest`, not `python3 -m pytest`: the installed package, not the source tree (setup.cfg: --import-mode=importlib)
PYTHONPATH=/tmp/site-gdn:/tmp/site-deps timeout 240 pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py \
  tests/test_gpu_engine.py tests/test_cuda_compile.py -k "gated_delta or golden or packed" 2>&1 | tail -30 \
  >"$OUT/gdn-suite.txt"
cd /tmp   # never import the source tree
for t in main gdn; do
  PYTHONPATH=/tmp/site-$t:/tmp/site-deps timeout 170 python3 -m clefcore.cli bench --precision fast \
    --no-transformers --lengths 2048,8192 --packed 16x512 --reps 3 --json "$OUT/bench-$t.json" 2>&1 \
    | sed "s/^/$t: /" >>"$OUT/bench-gdn.txt"
done
