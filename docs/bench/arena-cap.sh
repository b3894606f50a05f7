#!/usr/bin/env bash
# `clefcore serve` on a 16 GB V100's memory. A ballast process holds all of the GPU's memory but
# CAP_GIB (default 15.2: a V100-16GB's 15.78 GiB less a CUDA context), then the server starts text-only with its
# defaults (fast, --context-length 24576, --max-batch-tokens 16384 over 32 requests, --chunk-tokens 4096, CUDA
# graphs up to 1024 tokens) and reserves its activation arena at load (Engine.reserve). Limits that do not fit
# must fail the start, naming them; the script then tries smaller batches and token blocks, then shorter contexts,
# until one starts, and serves the loadtest's default mix with it (80/15/5 of ~1.2k/7.8k/24.6k tokens: the long
# ones run chunked beside batches).
#
# Prepare as for docs/bench/run-overload.sh (.whl/new, .whl/deps; carry [".whl"]); reuses its checkpoint
# (/tmp/clef-flash-synth) when the machine still has it. Run: bash docs/bench/arena-cap.sh
# Writes to $OUT: arena-cap-health.json (/health when ready and after the load), arena-cap-loadtest.json,
# arena-cap.log (memory figures, the refused starts' errors, the server's lifecycle and memory lines).
set -euo pipefail
OUT=${OUT:-/tmp/arena-cap-out}
CAP_GIB=${CAP_GIB:-15.2}
DUR=${DUR:-30}
MODEL=/tmp/clef-flash-synth
PORT=8090
ROOT=$(pwd)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site-new:/tmp/site-deps
LOG="$OUT/arena-cap.log"
started=$(date +%s)
stamp() { echo "[$(( $(date +%s) - started )) s] $*" | tee -a "$LOG"; }

python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-deps "$ROOT"/.whl/deps/*.whl
rm -rf /tmp/site-new
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-new "$ROOT"/.whl/new/clefcore-*.whl
cd /tmp   # never import the source tree
if [ ! -f "$MODEL/config.json" ]; then
  stamp "synthesizing the clef-flash checkpoint"
  python3 -m clefcore.cli synth --preset clef-flash --out "$MODEL" >/dev/null
fi

free_gib() { python3 -c "import cupy; f, t = cupy.cuda.runtime.memGetInfo(); print(f'{f / 2**30:.3f} of {t / 2**30:.3f}')"; }
python3 - "$CAP_GIB" /tmp/ballast.ready <<'PY' &
import sys, time, cupy
free, _ = cupy.cuda.runtime.memGetInfo()
ballast = cupy.empty(free - int(float(sys.argv[1]) * 2 ** 30), dtype=cupy.uint8)
open(sys.argv[2], "w").close()
time.sleep(3600)
PY
ballast=$!
rm -f /tmp/ballast.ready
until [ -f /tmp/ballast.ready ]; do kill -0 $ballast || exit 1; sleep 0.5; done
stamp "ballast held; GiB free for the server: $(free_gib)"

health() { python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$PORT/health').read().decode())"; }
serve() {  # serve <log> <extra flags...>: start, wait until ready; returns 1 if the server exited instead
  local log=$1; shift
  python3 -m clefcore.cli serve --model "$MODEL" --device cuda:0 --no-images --port "$PORT" "$@" 2>"$log" &
  pid=$!
  until health >/dev/null 2>&1; do
    kill -0 "$pid" 2>/dev/null || return 1
    sleep 1
  done
}

# the defaults first, then smaller batches, until one starts: the refused starts show the check at load
small="--max-batch-tokens 2048 --max-batch-requests 4 --chunk-tokens 2048 --token-block 1024 --graph-tokens 0"
smaller="--max-batch-tokens 1024 --max-batch-requests 2 --chunk-tokens 1024 --token-block 512 --graph-tokens 0"
configs=("" "$small" "--context-length 16384 $small" "--context-length 8192 $small" "--context-length 8192 $smaller")
started_with=none
for i in "${!configs[@]}"; do
  flags=${configs[$i]}
  stamp "start with: ${flags:-the defaults}"
  # shellcheck disable=SC2086  # flags is a list
  if serve "/tmp/cap-server-$i.log" $flags; then started_with=$i; break; fi
  code=0; wait "$pid" || code=$?
  stamp "refused at load, exit $code"
  grep -E '"event": "(load_failed|exit)"' "/tmp/cap-server-$i.log" | cut -c1-900 >>"$LOG" || true
done
if [ "$started_with" != none ]; then
  log=/tmp/cap-server-$started_with.log
  stamp "ready"
  health >"$OUT/arena-cap-health.json"
  stamp "GiB free with the server ready: $(free_gib)"
  python3 -m clefcore.cli loadtest --url "http://127.0.0.1:$PORT" --clients 16 --duration "$DUR" \
    --json "$OUT/arena-cap-loadtest.json" | tee -a "$LOG"
  health >>"$OUT/arena-cap-health.json"
  python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$PORT/metrics').read().decode())" \
    | grep -E "^clef_device_memory_bytes|^clef_requests_total|^clef_precision_fallbacks" >>"$LOG" || true
  stamp "GiB free after the load: $(free_gib)"
  kill -TERM "$pid"; code=0; wait "$pid" || code=$?
  stamp "server exit $code"
  grep -E '"event": "(ready|exit|unhandled)"|graph capture failed|out of memory' "$log" | cut -c1-600 >>"$LOG" || true
fi
kill $ballast
stamp "done"
