#!/usr/bin/env bash
# One device call: the fast plan's delta rule as it ships and under the gdn_split_scan and gdn_split switches
# (clefcore/switches.py).
#  0. the delta rule's GPU kernel tests (tests/test_kernels.py -k gated_delta);
#  1. gdn_fast_state.py (this folder): output and state errors over seeded draws, both variants;
#  2. the golden sets (text and images) in fast mode, native and compute_70 PTX, each variant: worst |dp|;
#  3. `clefcore bench` (fast, cuBLAS as the image ships, no transformers) as it ships and with gdn_split;
#  4. STEPS=suite adds the whole GPU suite at the defaults, with and without cuBLAS.
# Prepare here, in the repository root (.whl/ is ignored by git; carry [".whl"]):
#   PYENV_VERSION=3.12.1 python -m pip wheel --no-deps -w .whl/new .      # the device's python3 is 3.12
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl/deps prometheus_client Brotli backports.zstd uvloop ml_dtypes Pillow
#   the compute_70 PTX of every kernel file into .whl/ptx70 (CLEFCORE_KERNEL_CACHE), made with the pip NVRTC 12
# Run (device tool): CLEFCORE_KERNEL_CACHE=$PWD/.whl/ptx70 bash docs/bench/2026-12-06-h100-fast-delta-rule-margin/run-gdn-state.sh
# Writes to $OUT as it goes: kernels.txt, gdn-state.json, golden.txt, bench-none.json, bench-gdn_split.json,
# bench.txt, suite.txt. It names the switches of its commits (gdn_split, gdn_split_scan), since replaced.
set -uo pipefail
OUT=${OUT:-/tmp/gdn-state-out}
STEPS=${STEPS:-"kernels study golden bench"}
DRAWS=${DRAWS:-300}
mkdir -p "$OUT"
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$ROOT"/.whl/deps/*.whl \
  "$ROOT"/.whl/new/clefcore-*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv >"$OUT/device.txt" 2>&1
if [[ " $STEPS " == *" kernels "* ]]; then
  # the delta rule's kernel tests, both variants (their ERR lines: each check's error and the state's model)
  timeout 150 pytest -q -s -p no:cacheprovider -m gpu tests/test_kernels.py -k gated_delta 2>&1 \
    | grep -E "^ERR gdn|passed|failed|Error" >"$OUT/kernels.txt"
fi
if [[ " $STEPS " == *" study "* ]]; then
  (cd /tmp && timeout 200 python3 "$ROOT/docs/bench/2026-12-06-h100-fast-delta-rule-margin/gdn_fast_state.py" "$OUT/gdn-state.json" "$DRAWS") \
    2>&1 | tee "$OUT/study.txt"
fi
if [[ " $STEPS " == *" golden "* ]]; then
  for sw in none gdn_split_scan gdn_split; do
    # `pytest`, not `python3 -m pytest`: the installed package, not the source tree
    env "CLEFCORE_${sw^^}=1" timeout 150 pytest -q -s -p no:cacheprovider -m gpu tests/test_gpu_engine.py \
      tests/test_vision_gpu.py -k "golden and fast" 2>&1 | grep -E "GOLDEN|passed|failed|Error" \
      | sed "s/^/switch=$sw: /" | tee -a "$OUT/golden.txt"
  done
fi
if [[ " $STEPS " == *" bench "* ]]; then
  cd /tmp
  for sw in ${BENCH_SWITCHES:-none gdn_split}; do
    timeout 150 python3 -m clefcore.cli bench --precision fast --no-transformers --no-kernels --lengths 346,2048,8192 \
      --packed 16x512 --reps 3 --breakdown 2048 --kernels "${sw/none/}" --json "$OUT/bench-$sw.json" 2>&1 \
      | sed "s/^/$sw: /" | tee -a "$OUT/bench.txt"
  done
  cd "$ROOT"
fi
if [[ " $STEPS " == *" suite "* ]]; then
  timeout 300 pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -30 >"$OUT/suite.txt"
  PYTHONPATH=tests/no_cublas:$PYTHONPATH timeout 200 pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -30 \
    >>"$OUT/suite.txt"
fi
