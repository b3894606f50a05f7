#!/usr/bin/env bash
# Serving under overload in one device call: the three client behaviours against this tree's server and against
# the baseline at 0f26886, the same synthetic clef-flash checkpoint, --precision fast, the default mix.
#
# Prepare once, on the development machine, in the repository root: each tree as a cp312 wheel (the device's
# python3 is 3.12 and has no meson-python), and clefcore's dependencies that the device lacks, all under .whl/
# (ignored by git), which the device call carries:
#   py=python3.12   # e.g. /root/.pyenv/versions/3.12.1/bin/python3.12
#   git worktree add --detach /tmp/base-0f26886 0f26886 && $py -m pip wheel --no-deps -w .whl/b0f26886 /tmp/base-0f26886
#   $py -m pip wheel --no-deps -w .whl/new .
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl/deps prometheus_client Brotli backports.zstd uvloop ml_dtypes Pillow
# Run (device tool, repository root as cwd; carry [".whl"]):
#   bash docs/bench/run-overload.sh
# It writes to $OUT: {b0f26886,new}-{polite,open,storm}.json (clefcore loadtest reports), servers.log
# (per tree: lifecycle lines, the refusal lines' last 20 and the exit code), meta.json, traces.jsonl
# (per server and behaviour: where the answered short requests' time went, trace_summary.py): 9 files with
# both trees and all behaviours, one more than a device call returns: tar $OUT in the calling script, or run a
# subset (BEHAVIOURS) per call.
#
# Needs: python3 with numpy, cupy and aiohttp (the device image has them); nothing fetched. Each tree is installed
# from its wheel into a folder of its own and put on PYTHONPATH. The client is this tree's loadtest for both servers (the
# baseline's has no --no-backoff and no busy fraction; against the baseline the busy fraction is null).
#
# Behaviours, each DUR seconds (default 30):
#   polite: 64 clients, closed loop, each waits Retry-After (at most 1 s) after a 429/503
#   open:   --rate 15 (about 2x the device in prompt tokens), at most 256 in flight
#   storm:  64 clients, closed loop, each sends again at once after a 429/503 (--no-backoff)
# A dry run on a CPU (the tiny model, a few seconds each) checks the script itself:
#   PRESET=tiny SERVE_ARGS="--device cpu" DUR=3 OUT=/tmp/o bash docs/bench/run-overload.sh
# Expected wall time with DUR=30: checkpoint ~1.5 min, builds ~0.5 min, per server ~1 min to load and warm up
# plus 3 x ~35 s of load: ~7.5 min in all (estimated, not yet run on a GPU). A run lasts DUR plus the tail of
# the requests still in flight (in the CPU dry run the baseline's took up to 29 s more), so up to ~9 min: keep
# DUR <= 30 in a 10-minute call, or split it, TREES=b0f26886 in one call and TREES=new in the next (the checkpoint
# is written again if /tmp did not survive).
#
# VARIANTS runs this tree again with extra server flags, each as "label=flags", separated by ";", e.g.
#   VARIANTS="mbt4096=--max-batch-tokens 4096;mqw08=--min-queue-wait 0.8"
# writes new-mbt4096-<behaviour>.json and so on (more than 8 files: tar $OUT in the calling script).
# A dry run without wheels (SITE: where this tree is installed; PY: a python with its dependencies):
#   SITE=/tmp/site PY=venv/bin/python TREES=new PRESET=tiny SERVE_ARGS="--device cpu" DUR=3 OUT=/tmp/o \
#     bash docs/bench/run-overload.sh
set -euo pipefail
DUR=${DUR:-30}
VARIANTS=${VARIANTS:-}
PY=${PY:-python3}
OUT=${OUT:-/tmp/overload-out}
TREES=${TREES:-"b0f26886 new"}   # each a wheel folder under .whl/; "new" is this tree
BEHAVIOURS=${BEHAVIOURS:-"polite open storm"}   # a subset, to fit one 10-minute call
PRESET=${PRESET:-clef-flash}
SERVE_ARGS=${SERVE_ARGS:-"--device cuda:0 --precision fast"}
MODEL=/tmp/$PRESET-synth
PORT=8080
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

ROOT=$(pwd)
started=$(date +%s)
stamp() { echo "[$(( $(date +%s) - started )) s] $*"; }

install() {  # install <name>: .whl/<name>/clefcore-*.whl (built on the development machine) into /tmp/site-<name>
  rm -rf "/tmp/site-$1"
  $PY -m pip install -q --no-index --no-deps --no-compile --target "/tmp/site-$1" "$ROOT"/.whl/"$1"/clefcore-*.whl
}
site() {  # site <tree>: its PYTHONPATH
  if [ "$1" = new ] && [ -n "${SITE:-}" ]; then echo "$SITE"; else echo "/tmp/site-$1:/tmp/site-deps"; fi
}
stamp "installing"
if [ -z "${SITE:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-deps "$ROOT"/.whl/deps/*.whl
  install new
fi
for tree in $TREES; do [ "$tree" = new ] || install "$tree"; done

cd /tmp  # never import the source tree
if [ ! -f "$MODEL/config.json" ]; then
  stamp "synthesizing the $PRESET checkpoint"
  PYTHONPATH=$(site new) $PY -m clefcore.cli synth --preset "$PRESET" --out "$MODEL" >/dev/null
fi

$PY - "$OUT/meta.json" "$DUR" "$PRESET" "$SERVE_ARGS" "$VARIANTS" <<'EOF'
import json, shutil, subprocess, sys, time
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip() if shutil.which("nvidia-smi") else None
json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "gpu": gpu,
           "duration_s": float(sys.argv[2]), "model": f"synthetic {sys.argv[3]}",
           "server": f"{sys.argv[4]}, defaults otherwise", "variants of this tree": sys.argv[5],
           "mix": "the loadtest's default (80/15/5)"},
          open(sys.argv[1], "w"), indent=1)
EOF

loadtest() {  # loadtest <label> <behaviour> <args...>
  local label=$1 name=$2; shift 2
  local log=/tmp/server-$label.log from
  from=$(wc -l <"$log")
  stamp "$label: $name"
  PYTHONPATH=$(site new) $PY -m clefcore.cli loadtest --url "http://127.0.0.1:$PORT" --duration "$DUR" \
    --json "$OUT/$label-$name.json" "$@" | tee -a "/tmp/loadtest-$label.txt"
  # where the answered short requests' time went, from the server's request lines of this behaviour
  tail -n +"$((from + 1))" "$log" | $PY "$ROOT/docs/bench/trace_summary.py" "$label" "$name" \
    >>"$OUT/traces.jsonl" || true
}

run_server() {  # run_server <label> <tree> <extra serve flags...>: start it, run the behaviours, stop it
  local label=$1 tree=$2; shift 2
  local log=/tmp/server-$label.log
  # shellcheck disable=SC2086  # SERVE_ARGS is a list of flags
  PYTHONPATH=$(site "$tree") $PY -m clefcore.cli serve --model "$MODEL" $SERVE_ARGS "$@" --port "$PORT" 2>"$log" &
  pid=$!
  stamp "$label: loading (pid $pid)"
  until $PY -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:$PORT/health').status != 200)" 2>/dev/null; do
    kill -0 "$pid" 2>/dev/null || { tail -30 "$log"; exit 1; }
    sleep 1
  done
  stamp "$label: ready"
  [[ " $BEHAVIOURS " != *" polite "* ]] || loadtest "$label" polite --clients 64
  [[ " $BEHAVIOURS " != *" open "* ]] || loadtest "$label" open --rate 15 --clients 256
  [[ " $BEHAVIOURS " != *" storm "* ]] || loadtest "$label" storm --clients 64 --no-backoff
  kill -TERM "$pid"
  code=0; wait "$pid" || code=$?
  stamp "$label: exit $code"
  { grep -E '"event": "(listening|ready|draining|drained|drain_timeout|exit|load_failed|unhandled)"' "$log" || true
    grep '"event": "refused"' "$log" | tail -20 || true
    echo "exit code $code"; } | sed "s/^/$label: /" >>"$OUT/servers.log"
}

for tree in $TREES; do run_server "$tree" "$tree"; done
IFS=';' read -r -a variants <<<"$VARIANTS"
for variant in "${variants[@]}"; do
  # shellcheck disable=SC2086  # the variant's flags are a list
  [ -z "$variant" ] || run_server "new-${variant%%=*}" new ${variant#*=}
done
stamp "done"
