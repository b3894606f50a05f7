#!/usr/bin/env bash
# The serving checks in one device call that ends within 9 minutes: the image request against its text twin
# (fast, 1024x1024, clefcore alone), one forward's kernels by part (forward_profile.py, fast, 346 / 2,048 / 8,192
# tokens), then run-overload.sh's behaviours against the baseline wheel .whl/$BASE (default be233d56, e233d56's
# tree), DUR seconds each (default 20). Prepare .whl/ as run-overload.sh's header says (.whl/new, .whl/deps,
# .whl/$BASE); carry them. torch must be importable for the profile (the device's python3 has it).
# Writes to $OUT: image.json, image.txt, forward-profile.json, profile.txt, overload-log.txt and overload.tar (the
# overload's nine files: more than a call returns on their own).
# BEHAVIOURS: run-overload.sh's subset (default "polite storm"; all three need about 60 s more than a call has).
set -uo pipefail
OUT=${OUT:-/tmp/serving-checks-out}
BASE=${BASE:-be233d56}
ROOT=$(pwd)
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-deps "$ROOT"/.whl/deps/*.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-new "$ROOT"/.whl/new/clefcore-*.whl
(
  cd /tmp || exit 1   # never import the source tree
  export PYTHONPATH=/tmp/site-new:/tmp/site-deps PYTHONUNBUFFERED=1
  timeout "${T_IMAGE:-100}" python3 -m clefcore.cli bench --precision fast --image 1024x1024 --no-kernels --lengths "" \
    --packed "" --no-transformers --json "$OUT/image.json" >"$OUT/image.txt" 2>&1
  tail -3 "$OUT/image.txt"
  timeout "${T_PROFILE:-75}" python3 "$ROOT/docs/bench/forward_profile.py" fast 346,2048,8192 "$OUT/forward-profile.json" \
    >"$OUT/profile.txt" 2>&1
  tail -3 "$OUT/profile.txt"
)
mkdir -p /tmp/overload
# SITE: this tree and its dependencies as installed above (run-overload.sh installs only the baseline then)
BEHAVIOURS=${BEHAVIOURS:-"polite storm"} DUR=${DUR:-20} TREES="$BASE new" SITE=/tmp/site-new:/tmp/site-deps OUT=/tmp/overload \
  timeout "${T_OVERLOAD:-330}" bash docs/bench/run-overload.sh \
  >"$OUT/overload-log.txt" 2>&1
tar -C /tmp -cf "$OUT/overload.tar" overload
tail -3 "$OUT/overload-log.txt"
