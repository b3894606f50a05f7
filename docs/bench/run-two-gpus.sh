#!/usr/bin/env bash
# Serving on two GPUs in one device call (kind nvidia-h200-x2): `clefcore serve` on one GPU (the baseline), on
# two with --spread workers (a server process per GPU on one port, SO_REUSEPORT) and on two with --spread queue
# (one server process, a device process per GPU), each loaded by `clefcore loadtest` (64 clients, the default
# mix) twice: keep-alive connections, then a new connection per request. Synthetic clef-flash, --precision fast.
#
# Prepare as for docs/bench/run-overload.sh (.whl/new, .whl/deps; carry [".whl"]). Run:
#   bash docs/bench/run-two-gpus.sh                     # all three setups: ~9 min with DUR=40
#   SETUPS="one workers" bash docs/bench/run-two-gpus.sh # a subset, to fit a 10-minute call
# A dry run on a CPU (the tiny model) checks the script itself; SITE, a folder where clefcore is installed, skips
# the wheels (PY: a python3 with clefcore's dependencies):
#   SITE=/tmp/site PY=venv/bin/python PRESET=tiny DEVICE0=cpu DEVICE1=cpu DUR=3 OUT=/tmp/o \
#     bash docs/bench/run-two-gpus.sh
# Writes to $OUT: <setup>-<connections>.json (loadtest reports: prompt tokens/s, each device's busy
# fraction by lane, per class the answered share and p50/p99), servers.log (per setup: lifecycle lines,
# /health after the load, the /metrics request counters, the exit code after SIGTERM), meta.json.
set -euo pipefail
DUR=${DUR:-40}
OUT=${OUT:-/tmp/two-gpus-out}
SETUPS=${SETUPS:-"one workers queue"}
PRESET=${PRESET:-clef-flash}
DEVICE0=${DEVICE0:-cuda:0}
DEVICE1=${DEVICE1:-cuda:1}
MODEL=/tmp/$PRESET-synth
PORT=8080
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
ROOT=$(pwd)
started=$(date +%s)
stamp() { echo "[$(( $(date +%s) - started )) s] $*"; }

if [ -z "${SITE:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-deps "$ROOT"/.whl/deps/*.whl
  rm -rf /tmp/site-new
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-new "$ROOT"/.whl/new/clefcore-*.whl
  SITE=/tmp/site-new:/tmp/site-deps
fi
export PYTHONPATH=$SITE
cd /tmp   # never import the source tree
if [ ! -f "$MODEL/config.json" ]; then
  stamp "synthesizing the $PRESET checkpoint"
  $PY -m clefcore.cli synth --preset "$PRESET" --out "$MODEL" >/dev/null
fi
$PY - "$OUT/meta.json" "$DUR" "$PRESET" <<'EOF'
import json, shutil, subprocess, sys, time
gpus = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                      capture_output=True, text=True).stdout.strip().splitlines() if shutil.which("nvidia-smi") else []
json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "gpus": gpus,
           "duration_s": float(sys.argv[2]), "model": f"synthetic {sys.argv[3]}", "precision": "fast",
           "clients": 64, "mix": "the loadtest's default (80/15/5)"}, open(sys.argv[1], "w"), indent=1)
EOF

get() { $PY -c "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())" "$1"; }
for setup in $SETUPS; do
  case $setup in
    one) flags=(--device "$DEVICE0") ;;
    workers) flags=(--device "$DEVICE0,$DEVICE1" --spread workers) ;;
    queue) flags=(--device "$DEVICE0,$DEVICE1" --spread queue) ;;
    *) echo "unknown setup $setup" >&2; exit 2 ;;
  esac
  log=/tmp/server-$setup.log
  precision=(); [ "$DEVICE0" = cpu ] || precision=(--precision fast)
  $PY -m clefcore.cli serve --model "$MODEL" "${flags[@]}" "${precision[@]}" --port "$PORT" 2>"$log" &
  pid=$!
  stamp "$setup: loading (pid $pid)"
  until get "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; do
    kill -0 "$pid" 2>/dev/null || { tail -30 "$log"; exit 1; }
    sleep 1
  done
  stamp "$setup: ready"
  for connections in keep-alive new; do
    stamp "$setup: $connections"
    $PY -m clefcore.cli loadtest --url "http://127.0.0.1:$PORT" --clients 64 --duration "$DUR" \
      --connections "$connections" --json "$OUT/$setup-$connections.json"
    $PY -c "import json, sys; r = json.load(open(sys.argv[1])); print(r['prompt_tokens_per_s'], 'tok/s, busy',
r['device_busy_fraction'], r['device_busy_by_lane'], {k: (c['answered_share'], c.get('p50_ms'), c.get('p99_ms'))
for k, c in r['classes'].items()})" "$OUT/$setup-$connections.json"
  done
  { echo "== $setup: /health after the load"; get "http://127.0.0.1:$PORT/health"
    echo "== $setup: /metrics"
    get "http://127.0.0.1:$PORT/metrics" | grep -E "^clef_(requests_total|device_busy|devices|workers)" || true
  } >>"$OUT/servers.log"
  kill -TERM "$pid"
  code=0; wait "$pid" || code=$?
  stamp "$setup: exit $code"
  events='"event": "(listening|ready|draining|drained|drain_timeout|exit|load_failed|unhandled|worker)'
  { grep -E "$events" "$log" || true
    echo "exit code $code"; } | sed "s/^/$setup: /" >>"$OUT/servers.log"
done
stamp "done"
