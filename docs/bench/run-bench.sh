#!/usr/bin/env bash
# clefcore bench at the image's defaults against transformers + flash-linear-attention (its conv through FLA's
# kernel: clefcore/bench/peers.py) in the same process, fast and exact, with the kernel table under fast, then the
# delta rule alone under Nsight Compute at 8,192 tokens. Ends within 9 minutes; writes to $OUT as it goes:
# bench.json / bench.txt, gdn-ncu.txt, device.txt.
# Prepare here as run-gpu-validate.sh's header says (.whl/new, .whl/deps, .whl/ptx70), and for the peer:
#   pip download --no-deps -d .whl/fla flash-linear-attention==0.6.0 fla-core==0.6.0 einops
# Run (device tool, carry [".whl"]): bash docs/bench/run-bench.sh   (KERNELS=...: passed as --kernels)
set -uo pipefail
OUT=${OUT:-/tmp/bench-out}
mkdir -p "$OUT"
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$ROOT"/.whl/deps/*.whl \
  "$ROOT"/.whl/new/clefcore-*.whl "$ROOT"/.whl/fla/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv >"$OUT/device.txt" 2>&1
git -C "$ROOT" rev-parse HEAD >>"$OUT/device.txt" 2>/dev/null || true
kernels=()
if [ -n "${KERNELS:-}" ]; then kernels=(--kernels "$KERNELS"); fi
# shellcheck disable=SC2054  # the commas are inside the --lengths value
timeout "${T_BENCH:-420}" python3 -m clefcore.cli bench --json "$OUT/bench.json" --precision fast,exact \
  --lengths 346,2048,8192,24576 --packed 16x512 --reps 3 --breakdown 346 "${kernels[@]}" 2>&1 | tee "$OUT/bench.txt" | tail -60
timeout "${T_NCU:-90}" ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section LaunchStats \
  --section MemoryWorkloadAnalysis python3 "$ROOT/docs/bench/gdn_profile.py" 8192 fast >"$OUT/gdn-ncu.txt" 2>&1
grep -E "gated delta rule|gdn_|Duration|Memory Throughput|Compute \(SM\)|Registers|Achieved Occupancy|DRAM Through" \
  "$OUT/gdn-ncu.txt" | head -60
