#!/usr/bin/env bash
# A kernel switch, checked then timed against the defaults in one device call that ends within 9 minutes:
#   1. its GPU tests: the op table's rows on its variants (tests/test_ops.py -k SWITCH), then the golden sets
#      (text and images, every mode, natively and through the compute_70 PTX) with it on (CLEFCORE_<SWITCH>=1),
#      each worst |dp| printed;
#   2. the delta rule alone at 8,192 tokens, fast, without and with it (gdn_profile.py, CUDA events);
#   3. clefcore bench, fast, end to end at 2,048 and 8,192 tokens and 16 x 512 packed, without and with it,
#      alternating (A B A B), no kernel table, no peer.
# Nothing is timed unless step 1 passed. Prepare .whl/new, .whl/deps and .whl/ptx70 as run-gpu-validate.sh's header
# says; carry them. Run (device tool): SWITCH=wy_one_pass bash docs/bench/run-switch-ab.sh
# Writes to $OUT as it goes: device.txt, tests.txt, gdn.txt, bench-{off,on}-{1,2}.json and bench.txt.
set -uo pipefail
OUT=${OUT:-/tmp/switch-ab-out}
SWITCH=${SWITCH:?name the switch, e.g. SWITCH=wy_one_pass}
ROOT=$(pwd)
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$ROOT"/.whl/deps/*.whl \
  "$ROOT"/.whl/new/clefcore-*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv >"$OUT/device.txt" 2>&1
# `pytest`, not `python3 -m pytest`: the installed package, not the source tree (setup.cfg: --import-mode=importlib)
timeout "${T_TESTS:-120}" pytest -q -p no:cacheprovider -m gpu tests/test_ops.py -k "$SWITCH" 2>&1 \
  | grep -E "passed|failed|FAILED|Error" | tee "$OUT/tests.txt"
env "CLEFCORE_${SWITCH^^}=1" timeout "${T_GOLDEN:-90}" pytest -q -s -p no:cacheprovider -m gpu tests/test_gpu_engine.py \
  tests/test_vision_gpu.py -k "golden and probabilities" 2>&1 | grep -E "GOLDEN|passed|failed|FAILED|Error" \
  | tee -a "$OUT/tests.txt"
if ! grep -q " passed" "$OUT/tests.txt" || grep -qE "failed|FAILED|Error" "$OUT/tests.txt"; then
  echo "the switch's tests did not all pass: nothing timed"; exit 1
fi
cd /tmp || exit 1   # never import the source tree
for kernels in "" "$SWITCH"; do
  # shellcheck disable=SC2086  # no argument where no switch
  timeout 60 python3 "$ROOT/docs/bench/gdn_profile.py" 8192 fast $kernels 2>&1 | grep "gated delta rule" \
    | tee -a "$OUT/gdn.txt"
done
for run in 1 2; do
  for side in off on; do
    kernels=()
    [ "$side" = on ] && kernels=(--kernels "$SWITCH")
    # shellcheck disable=SC2054  # the commas are inside the --lengths value
    timeout "${T_BENCH:-60}" python3 -m clefcore.cli bench --precision fast --lengths 2048,8192 \
      --packed 16x512 --reps 3 --no-kernels --no-transformers "${kernels[@]}" --json "$OUT/bench-$side-$run.json" \
      2>&1 | grep -E "tokens|packed" | sed "s/^/$side $run: /" | tee -a "$OUT/bench.txt"
  done
done
