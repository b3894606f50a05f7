"""Where the answered short requests' time went: reads a server's log lines (stdin), keeps the answered requests
of at most 2,048 prompt tokens and prints one JSON line: percentiles of each part of their time (queue_ms: enqueue
to batch start; prefill_ms: their batch's forward; rest_ms: the request's time outside both, i.e. reading,
tokenizing and the answer's way out) and of their batch's size, plus the ten slowest lines in full and the first 40
lines that are neither requests nor refusals (autotune, warnings: what else ran meanwhile).

    python3 trace_summary.py <label> <behaviour> < server.log
"""

import json
import sys


def percentile(values, q):
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 1) if values else None


lines, other = [], []
for raw in sys.stdin:
    try:
        line = json.loads(raw)
    except ValueError:
        other.append(raw.strip()[:300])
        continue
    if line.get("event") not in ("request", "refused"):
        other.append(line)
    if line.get("event") == "request" and line.get("status") == 200 and line.get("prompt_tokens", 1e9) <= 2048:
        line["rest_ms"] = line["duration_ms"] - line.get("queue_ms", 0) - line.get("prefill_ms", 0)
        lines.append(line)
parts = ("duration_ms", "queue_ms", "prefill_ms", "rest_ms", "batch_tokens", "batch_requests")
summary = {"label": sys.argv[1], "behaviour": sys.argv[2], "answered": len(lines),
           **{part: {q: percentile([line.get(part, 0) for line in lines], p)
                     for q, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))} for part in parts},
           "slowest": sorted(lines, key=lambda line: -line["duration_ms"])[:10], "other": other[:40]}
print(json.dumps(summary))
