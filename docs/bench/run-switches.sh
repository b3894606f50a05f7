#!/usr/bin/env bash
# The kernel switches that default off (clefcore/switches.py), validated and timed on a GPU: one script, one STEP
# per device call (each ends within 9 minutes), writing to $OUT as it goes.
#   STEP=validate: docs/bench/run-gpu-validate.sh with every default-off switch on (CLEFCORE_<NAME>=1): the golden
#     sets in every mode with their worst |dp| (native and compute_70 PTX), the whole GPU suite with cuBLAS, the
#     kernel and engine suites without cuBLAS. Run it three times (three calls) for "three runs in a row".
#   STEP=bench: clefcore bench, fast and exact, against transformers + flash-linear-attention in the same process,
#     with the defaults (defaults.json) and then with every default-off switch on (switches-on.json), each with
#     the 346-token case broken down (backbone, head, the head's host launches, over requests of its question
#     schema whose states differ in length).
#   STEP=each: fast only, each default-off switch alone (each-<name>.json), to tell which one buys what.
#   STEP=lean: STEP=bench's fast cases in a process that cannot load cuBLAS (the lean image), both ways.
# gdn_one_pass is left as it is: it ran on GPUs and is off for fast's golden margin, not for want of a run.
# Prepare here, in the repository root, as run-gpu-validate.sh's header says (.whl/new, .whl/deps, .whl/ptx70),
# and for the peer: pip download --no-deps -d .whl/fla flash-linear-attention==0.6.0 fla-core==0.6.0
# Run (device tool, carry [".whl"]): STEP=validate CLEFCORE_KERNEL_CACHE=$PWD/.whl/ptx70 bash docs/bench/run-switches.sh
set -uo pipefail
OUT=${OUT:-/tmp/switches-out}
mkdir -p "$OUT"
ROOT=$(pwd)
STEP=${STEP:-validate}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$ROOT"/.whl/deps/*.whl \
  "$ROOT"/.whl/new/clefcore-*.whl
if compgen -G "$ROOT/.whl/fla/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$ROOT"/.whl/fla/*.whl
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
NEW=$(python3 -c "from clefcore import switches as s
print(','.join(x.name for x in s.SWITCHES if not x.default and x.name != 'gdn_one_pass'))")
echo "default-off switches under test: $NEW" | tee "$OUT/switches.txt"
git -C "$ROOT" rev-parse HEAD >>"$OUT/switches.txt" 2>/dev/null || true
nvidia-smi --query-gpu=name,driver_version --format=csv >"$OUT/device.txt" 2>&1

bench() {  # bench <json> <timeout> <flags...>
  local json=$1 limit=$2
  shift 2
  timeout "$limit" python3 -m clefcore.cli bench --json "$OUT/$json" "$@" 2>&1 | tail -40 | tee "$OUT/${json%.json}.txt"
}

case "$STEP" in
  validate)
    for name in ${NEW//,/ }; do export "CLEFCORE_${name^^}=1"; done
    # the suite has grown by the switches' own GPU tests: more of the 9 minutes to it
    T_GOLDEN=${T_GOLDEN:-80} T_SUITE=${T_SUITE:-300} T_LEAN=${T_LEAN:-120} bash "$ROOT/docs/bench/run-gpu-validate.sh"
    ;;
  bench)
    # shellcheck disable=SC2054  # the commas are inside the --lengths value
    common=(--lengths 346,2048,8192 --packed 16x512 --reps 3 --no-kernels --breakdown 346)
    bench defaults.json 280 --precision fast,exact "${common[@]}"
    bench switches-on.json 230 --precision fast,exact --no-transformers --kernels "$NEW" "${common[@]}"
    ;;
  each)
    for name in ${NEW//,/ }; do
      bench "each-$name.json" 120 --precision fast --no-transformers --no-kernels --lengths 346,2048,8192 \
        --packed 16x512 --reps 3 --kernels "$name"
    done
    ;;
  lean)
    export PYTHONPATH=$ROOT/tests/no_cublas:$PYTHONPATH
    # shellcheck disable=SC2054  # the commas are inside the --lengths value
    common=(--precision fast --no-transformers --no-kernels --lengths 2048,8192 --packed 16x512 --reps 3)
    bench lean-defaults.json 200 "${common[@]}"
    bench lean-switches-on.json 200 "${common[@]}" --kernels "$NEW"
    ;;
  *)
    echo "STEP must be validate, bench, each or lean, not $STEP" >&2
    exit 2
    ;;
esac
