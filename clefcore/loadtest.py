"""`clefcore loadtest`: offered load against a running server, by request class, as in issue 20.

Clients send System One requests whose states are sized to a class's prompt tokens. The client has no
tokenizer: two probe requests first measure the server's tokens per state word and the prompt's fixed part
(``usage.input_tokens``), and the states are sized from those (``--sizing`` gives them instead, e.g. from an
earlier run's report, for a run that starts beside another one's load); the report gives the server's own count.
Closed loop (each client sends its next request when the last is answered) or a fixed rate (a request every
1/rate seconds, at most ``--clients`` in flight). After a 429 or 503 a closed-loop client waits Retry-After
(at most ``--max-backoff``) before its next draw; with ``--no-backoff`` it sends at once, and at a fixed rate
the refused request itself is sent again at once until it is answered otherwise or the run ends. The report:
per class, the answered share of attempts, latency percentiles of the answered (200) requests and their
prompt tokens; throughput; every non-200 by status, and refusals' own latency (a 429 should be fast); the
devices' mean busy fraction over the run, from the server's /metrics (``clef_device_busy_seconds_total``, summed
over its lanes, over ``clef_devices``; absent from servers that do not count it), and each device's where one
server process runs several (``--spread queue``: a series per lane). Each side's event-loop lag (how late a
20 ms timer woke): the client's own, which bounds how far its latencies are the server's, and the server's from
``clef_event_loop_lag_seconds``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field

from .example_request import support_ticket

DEFAULT_MIX = "short:0.80:1200,medium:0.15:7800,long:0.05:24576"
ROUTES = {"systemone": "/v1/systemone",
          "workers-ai": "/client/v4/accounts/loadtest/ai/run/@cf/cloudflare/clef-flash"}
# Common English words: one token each (with their leading space) in Qwen's vocabulary; other tokenizers
# (a synthetic checkpoint's) split them, which the probes measure.
_WORDS = ("the customer order payment failed again after checkout service error page login account team "
          "billing refund invoice network timeout region server node retry request support ticket urgent "
          "card bank transfer user reports issue since morning today app mobile web site down slow").split()
# The schema and chat template around the state take about this many tokens with Qwen's vocabulary (the
# example request's three questions): the sizing used when the probes cannot run.
_OVERHEAD_TOKENS = 260
_PROBE_WORDS = 400
LAG_EVERY_S = 0.02


@dataclass(frozen=True)
class Sizing:
    """Prompt tokens = fixed + per_word * state words, as the server counted them for the probes."""
    fixed: float = _OVERHEAD_TOKENS
    per_word: float = 1.0
    measured: bool = False

    def words(self, tokens: int) -> int:
        return max(1, round((tokens - self.fixed) / self.per_word))


@dataclass(frozen=True)
class RequestClass:
    name: str
    share: float
    tokens: int


@dataclass
class Record:
    cls: str
    status: int | str      # HTTP status, or the transport error's name
    latency_s: float
    input_tokens: int = 0
    reason: str | None = None   # a 429's error.reason: queued_work, queue_full, evicted (it had waited)
    done_at: float = 0.0        # when it ended (time.monotonic())


@dataclass
class Run:
    records: list = field(default_factory=list)
    sizing: Sizing = field(default_factory=Sizing)
    started: float = 0.0
    offered_s: float = 0.0     # how long load was offered; the run ends later, when the requests in flight do
    ended: float = 0.0
    busy_s: float | None = None    # device-seconds the server counted between start and end, per device
    lanes_busy_s: dict | None = None   # the same for each device of one server process on several (by lane)
    client_lag_s: list = field(default_factory=list)   # this process's loop lag, one sample per LAG_EVERY_S
    server_lag: dict | None = None   # the server's loop-lag histogram over the run: upper bound (s) -> count


def parse_mix(text: str) -> list[RequestClass]:
    """``name:share:tokens,...``; shares are normalised to sum to 1."""
    classes = []
    for part in text.split(","):
        pieces = part.strip().split(":")
        if len(pieces) != 3 or not pieces[0]:
            raise ValueError(f"each class is name:share:tokens, got {part.strip()!r}")
        name, share, tokens = pieces
        try:
            share_v, tokens_v = float(share), int(tokens)
        except ValueError:
            raise ValueError(f"share must be a number and tokens an integer in {part.strip()!r}") from None
        if not (share_v > 0 and math.isfinite(share_v)) or tokens_v < 1:
            raise ValueError(f"share must be > 0 and tokens >= 1 in {part.strip()!r}")
        if any(c.name == name for c in classes):
            raise ValueError(f"class {name!r} named twice")
        classes.append(RequestClass(name, share_v, tokens_v))
    total = sum(c.share for c in classes)
    return [RequestClass(c.name, c.share / total, c.tokens) for c in classes]


def make_body(tokens: int, rng: random.Random, sizing: Sizing = Sizing()) -> dict:
    state = " ".join(rng.choice(_WORDS) for _ in range(sizing.words(tokens)))
    return support_ticket(state=state)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))]


def summarize(run: Run, classes: list[RequestClass]) -> dict:
    seconds = max(run.ended - run.started, 1e-9)
    ok = [r for r in run.records if r.status == 200]
    # while load was offered: a server that queues deeper than another ends its run later by its queue's drain
    offered = [r for r in ok if r.done_at <= run.started + run.offered_s] if run.offered_s > 0 else []
    report = {"duration_s": round(seconds, 3), "requests": len(run.records), "ok": len(ok),
              "requests_per_s": round(len(ok) / seconds, 3),
              "prompt_tokens_per_s": round(sum(r.input_tokens for r in ok) / seconds, 1),
              "offered_s": run.offered_s,
              "offered_requests_per_s": round(len(offered) / run.offered_s, 3) if run.offered_s > 0 else None,
              "offered_prompt_tokens_per_s": (round(sum(r.input_tokens for r in offered) / run.offered_s, 1)
                                              if run.offered_s > 0 else None),
              "device_busy_fraction": None if run.busy_s is None else round(run.busy_s / seconds, 3),
              "device_busy_by_lane": None if run.lanes_busy_s is None else {
                  lane: round(busy / seconds, 3) for lane, busy in run.lanes_busy_s.items()},
              "classes": {}, "non_200": {}}
    for cls in classes:
        mine = [r for r in run.records if r.cls == cls.name]
        answered = [r for r in mine if r.status == 200]
        refused = [r.latency_s for r in mine if r.status == 429]
        entry = {"sent": len(mine), "ok": len(answered), "target_tokens": cls.tokens,
                 "answered_share": round(len(answered) / len(mine), 4) if mine else None,
                 "ok_per_s": round(len(answered) / seconds, 3), "refused": len(refused),
                 "refused_p99_ms": _ms(refused, 99) if refused else None}
        if answered:
            latencies = [r.latency_s for r in answered]
            entry.update({f"p{q}_ms": round(percentile(latencies, q) * 1000, 1) for q in (50, 90, 99)},
                         mean_input_tokens=round(sum(r.input_tokens for r in answered) / len(answered), 1))
        report["classes"][cls.name] = entry
    for r in run.records:
        if r.status != 200:
            key = str(r.status)
            report["non_200"][key] = report["non_200"].get(key, 0) + 1
    # refused on arrival (queued_work, queue_full) and refused after waiting in the queue (evicted)
    by_reason: dict[str, list[float]] = {}
    for r in run.records:
        if r.status == 429:
            by_reason.setdefault(r.reason or "unknown", []).append(r.latency_s)
    if by_reason:
        refused = [latency for latencies in by_reason.values() for latency in latencies]
        report["refused_p50_ms"], report["refused_p99_ms"] = _ms(refused, 50), _ms(refused, 99)
        report["refused_by_reason"] = {reason: {"count": len(v), "p50_ms": _ms(v, 50), "p99_ms": _ms(v, 99)}
                                       for reason, v in sorted(by_reason.items())}
    report["loop_lag"] = {"client": {"p50_ms": _ms(run.client_lag_s, 50), "p99_ms": _ms(run.client_lag_s, 99),
                                     "max_ms": _ms(run.client_lag_s, 100)} if run.client_lag_s else None,
                          "server": _histogram_summary(run.server_lag)}
    return report


def _histogram_summary(counts: dict | None) -> dict | None:
    """A Prometheus histogram's deltas (upper bound in s -> cumulative count) as the bound under which 50 % and
    99 % of the samples fell (None: beyond the last finite bound) and the share above 50 ms."""
    if not counts or not counts.get(math.inf):
        return None
    total = counts[math.inf]

    def bound_ms(q: float) -> float | None:
        le = min(le for le, n in counts.items() if n >= q * total)
        return None if le == math.inf else round(le * 1000, 1)

    over = total - max((n for le, n in counts.items() if le <= 0.05), default=0.0)
    return {"samples": int(total), "p50_ms_at_most": bound_ms(0.5), "p99_ms_at_most": bound_ms(0.99),
            "over_50ms_share": round(over / total, 4)}


def _ms(latencies_s: list[float], q: float) -> float:
    return round(percentile(latencies_s, q) * 1000, 1)


def format_report(report: dict) -> str:
    busy = report["device_busy_fraction"]
    lines = [f"{report['requests']} requests in {report['duration_s']} s, {report['ok']} answered: "
             f"{report['requests_per_s']} req/s, {report['prompt_tokens_per_s']} prompt tokens/s; "
             + (f"device busy {busy:.1%}" if busy is not None else "device busy: not reported by the server")
             + "".join(f", device {lane} {share:.1%}" for lane, share in (report["device_busy_by_lane"] or {}).items())]
    if report["offered_requests_per_s"] is not None:
        lines.append(f"  while offered ({report['offered_s']} s): {report['offered_requests_per_s']} req/s, "
                     f"{report['offered_prompt_tokens_per_s']} prompt tokens/s")
    for name, c in report["classes"].items():
        head = f"  {name:<8} sent {c['sent']:>6} ok {c['ok']:>6} ({(c['answered_share'] or 0):>6.1%})"
        if c["ok"]:
            head += (f"  ~{c['mean_input_tokens']:>8} tokens  "
                     f"p50 {c['p50_ms']:>9} ms  p90 {c['p90_ms']:>9} ms  p99 {c['p99_ms']:>9} ms")
        if c["refused"]:
            head += f"  429 {c['refused']}: p99 {c['refused_p99_ms']} ms"
        lines.append(head)
    if report["non_200"]:
        lines.append("  non-200: " + ", ".join(f"{k}: {v}" for k, v in sorted(report["non_200"].items())))
    if "refused_p50_ms" in report:
        lines.append(f"  429 latency p50 {report['refused_p50_ms']} ms, p99 {report['refused_p99_ms']} ms; "
                     + ", ".join(f"{reason} {r['count']}: p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms"
                                 for reason, r in report["refused_by_reason"].items()))
    client, server = report["loop_lag"]["client"], report["loop_lag"]["server"]
    if client is not None:
        lines.append(f"  event-loop lag: client p50 {client['p50_ms']} ms, p99 {client['p99_ms']} ms, max "
                     f"{client['max_ms']} ms; server " + ("not reported" if server is None else
                                                          f"p99 <= {server['p99_ms_at_most']} ms, "
                                                          f"{server['over_50ms_share']:.2%} over 50 ms"))
    return "\n".join(lines)


async def _one(http, path: str, cls: RequestClass, body: bytes, headers: dict,
               run: Run) -> tuple[int | str, float]:
    """Send one request, record it; returns its status and the backoff a 429 or 503 asked for (0 otherwise;
    0.1 after a transport error)."""
    import aiohttp

    sent = time.monotonic()
    try:
        async with http.post(path, data=body, headers=headers) as reply:
            data = await reply.read()
            done = time.monotonic()
            record = Record(cls.name, reply.status, done - sent, done_at=done)
            if reply.status == 200:
                answer = json.loads(data)
                answer = answer.get("result", answer)  # the Workers AI envelope
                record.input_tokens = int(answer.get("usage", {}).get("input_tokens", 0))
            elif reply.status == 429:
                record.reason = _refusal_reason(data)
            run.records.append(record)
            if reply.status in (429, 503):
                return reply.status, float(reply.headers.get("Retry-After", "1") or 1)
            return reply.status, 0.0
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as error:
        done = time.monotonic()
        run.records.append(Record(cls.name, type(error).__name__, done - sent, done_at=done))
        return type(error).__name__, 0.1


def _refusal_reason(data: bytes) -> str:
    """The reason a 429's bare body gives (clefcore's own routes); "unknown" for any other body."""
    try:
        error = json.loads(data).get("error")
    except (ValueError, AttributeError):
        return "unknown"
    reason = error.get("reason") if isinstance(error, dict) else None
    return reason if isinstance(reason, str) else "unknown"


async def _count(http, path: str, body: dict, headers: dict, tries: int = 10) -> int | None:
    """The server's prompt tokens for ``body`` (None when it did not answer 200); a 429 or 503 is tried again
    after its Retry-After (at most 1 s), as a busy server may refuse a probe."""
    for _ in range(tries):
        async with http.post(path, json=body, headers=headers) as reply:
            if reply.status in (429, 503):
                await asyncio.sleep(min(1.0, float(reply.headers.get("Retry-After", "1") or 1)))
                continue
            if reply.status != 200:
                return None
            answer = json.loads(await reply.read())
            return int(answer.get("result", answer).get("usage", {}).get("input_tokens", 0)) or None
    return None


@dataclass
class Counts:
    """What the server's /metrics says so far. Its device-seconds per device (``clef_device_busy_seconds_total``,
    every lane's series, over ``clef_devices``; servers from before lanes: unlabelled, over ``clef_workers``) and
    by lane, None when it does not count them; its event-loop lag histogram (upper bound in s -> cumulative
    count, summed over workers; empty when it does not keep one)."""
    per_device_s: float | None
    lanes_s: dict
    loop_lag: dict


async def server_counts(http) -> Counts | None:
    """The server's /metrics, read for the report; None when it cannot be read."""
    import aiohttp

    values, lanes, lag = {}, {}, {}
    try:
        async with http.get("/metrics") as reply:
            if reply.status != 200:
                return None
            for line in (await reply.text()).splitlines():
                series, _, value = line.rpartition(" ")
                name, _, labels = series.partition("{")
                if name in ("clef_device_busy_seconds_total", "clef_devices", "clef_workers"):
                    values[name] = values.get(name, 0.0) + float(value)
                if name == "clef_device_busy_seconds_total" and labels.startswith('lane="'):
                    lanes[labels.split('"')[1]] = float(value)
                if name == "clef_event_loop_lag_seconds_bucket" and 'le="' in labels:
                    le = float(labels.split('le="')[1].split('"')[0])
                    lag[le] = lag.get(le, 0.0) + float(value)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return None
    busy = values.get("clef_device_busy_seconds_total")
    devices = values.get("clef_devices", values.get("clef_workers", 1.0))
    return Counts(None if busy is None else busy / max(1.0, devices), lanes, lag)


async def _sample_lag(into: list, stop_at: float) -> None:
    """This process's event-loop lag until ``stop_at``: how late each LAG_EVERY_S sleep returned."""
    while time.monotonic() < stop_at:
        asked = time.monotonic()
        await asyncio.sleep(LAG_EVERY_S)
        into.append(max(0.0, time.monotonic() - asked - LAG_EVERY_S))


async def calibrate(http, path: str, headers: dict, rng: random.Random) -> Sizing:
    """Two probes, one state word and _PROBE_WORDS words: the server's fixed tokens and tokens per word."""
    import aiohttp

    one = Sizing(fixed=0.0, per_word=1.0)
    try:
        counts = [await _count(http, path, make_body(n, rng, one), headers) for n in (1, _PROBE_WORDS)]
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as error:
        counts = [type(error).__name__]
    if None in counts or counts[1] <= counts[0]:
        print(f"loadtest: the probes were not answered ({counts}); states sized for Qwen's vocabulary",
              file=sys.stderr)
        return Sizing()
    per_word = (counts[1] - counts[0]) / (_PROBE_WORDS - 1)
    return Sizing(fixed=counts[0] - per_word, per_word=per_word, measured=True)


async def _drive(args: argparse.Namespace, classes: list[RequestClass]) -> Run:
    import aiohttp

    rng = random.Random(args.seed)
    path = ROUTES[args.route]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    weights = [c.share for c in classes]
    run = Run()
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    # keep-alive: each client reuses its connection, as a gateway does (and SO_REUSEPORT then pins it to one
    # worker); new: a connection per request, which the kernel spreads over the workers one by one
    connector = aiohttp.TCPConnector(limit=args.clients, force_close=args.connections == "new")
    async with aiohttp.ClientSession(args.url, timeout=timeout, connector=connector) as http:
        run.sizing = args.sizing if args.sizing is not None else await calibrate(http, path, headers, rng)
        # Bodies are built and encoded once per class: a 24k-word state made or serialised per request would
        # load the client's loop, and its latencies would be its own.
        bodies = {c.name: [json.dumps(make_body(c.tokens, random.Random(rng.random()), run.sizing)).encode()
                           for _ in range(4)] for c in classes}
        headers = {**headers, "Content-Type": "application/json"}
        at_start = await server_counts(http)
        run.started = time.monotonic()
        stop_at = run.started + args.duration
        run.offered_s = args.duration
        lag = asyncio.ensure_future(_sample_lag(run.client_lag_s, stop_at))

        def pick() -> tuple[RequestClass, bytes]:
            cls = rng.choices(classes, weights)[0]
            return cls, rng.choice(bodies[cls.name])

        if args.rate:
            slots = asyncio.Semaphore(args.clients)
            tasks = set()

            async def fire(cls, body):
                try:
                    status, _ = await _one(http, path, cls, body, headers, run)
                    while args.no_backoff and status in (429, 503) and time.monotonic() < stop_at:
                        status, _ = await _one(http, path, cls, body, headers, run)  # the refused one again
                finally:
                    slots.release()

            next_at = run.started
            while next_at < stop_at:
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                next_at += 1.0 / args.rate
                if slots.locked():  # every client busy: the offered request is dropped and counted
                    run.records.append(Record(pick()[0].name, "client_busy", 0.0))
                    continue
                await slots.acquire()
                task = asyncio.ensure_future(fire(*pick()))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.gather(*tasks)
        else:
            async def client():
                while time.monotonic() < stop_at:
                    _, backoff = await _one(http, path, *pick(), headers, run)
                    if backoff and not args.no_backoff:
                        await asyncio.sleep(min(backoff, args.max_backoff))

            await asyncio.gather(*(client() for _ in range(args.clients)))
        run.ended = time.monotonic()
        await lag
        at_end = await server_counts(http)
        if at_start is not None and at_end is not None:
            if at_start.per_device_s is not None and at_end.per_device_s is not None:
                run.busy_s = at_end.per_device_s - at_start.per_device_s
            if len(at_end.lanes_s) > 1:   # one process on several devices: each one's own
                run.lanes_busy_s = {lane: busy - at_start.lanes_s.get(lane, 0.0)
                                    for lane, busy in at_end.lanes_s.items()}
            if at_end.loop_lag:
                run.server_lag = {le: n - at_start.loop_lag.get(le, 0.0) for le, n in at_end.loop_lag.items()}
    return run


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def _sizing(text: str) -> Sizing:
    """``FIXED:PER_WORD`` (a report's ``sizing``): prompt tokens = FIXED + PER_WORD x state words."""
    try:
        fixed, per_word = (float(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be FIXED:PER_WORD (two numbers), got {text!r}") from None
    if not (fixed >= 0 and per_word > 0 and math.isfinite(fixed + per_word)):
        raise argparse.ArgumentTypeError(f"needs FIXED >= 0 and PER_WORD > 0, got {text!r}")
    return Sizing(fixed=fixed, per_word=per_word)


def _mix(text: str) -> list[RequestClass]:
    try:
        return parse_mix(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="the server's base URL")
    parser.add_argument("--route", choices=tuple(ROUTES), default="systemone",
                        help="POST /v1/systemone or the Workers AI route")
    parser.add_argument("--clients", type=_positive(int), default=64,
                        help="concurrent clients (closed loop), or the most requests in flight (--rate)")
    parser.add_argument("--duration", type=_positive(float), default=45.0, help="seconds of offered load")
    parser.add_argument("--rate", type=_positive(float), default=None,
                        help="send this many requests per second (open loop) instead of a closed loop "
                             "(default: off, a closed loop)")
    parser.add_argument("--mix", type=_mix, default=DEFAULT_MIX,   # argparse parses a string default
                        help="request classes, name:share:prompt_tokens,...")
    parser.add_argument("--sizing", type=_sizing, default=None,
                        help="FIXED:PER_WORD: size states as prompt tokens = FIXED + PER_WORD x words, as an earlier "
                             "run's report (sizing) gives, instead of probing the server first (default: probe)")
    parser.add_argument("--timeout", type=_positive(float), default=120.0,
                        help="client timeout per request, s")
    parser.add_argument("--max-backoff", type=float, default=1.0,
                        help="closed loop: after a 429/503 wait Retry-After, at most this many seconds")
    parser.add_argument("--no-backoff", action="store_true",
                        help="after a 429/503 send again at once: a closed-loop client its next request, at "
                             "a fixed rate the refused request itself (a retry storm)")
    parser.add_argument("--connections", choices=("keep-alive", "new"), default="keep-alive",
                        help="keep-alive: each client reuses one connection; new: a connection per request")
    parser.add_argument("--api-key", default=None,
                        help="sent as Authorization: Bearer (default: none, for a server without --api-key)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the random request bodies and the class each request is drawn from")
    parser.add_argument("--json", default=None,
                        help="also write the report as JSON to this file (- : stdout; default: the text report only)")


def run(args: argparse.Namespace) -> int:
    result = asyncio.run(_drive(args, args.mix))
    report = summarize(result, args.mix)
    report["sizing"] = asdict(result.sizing)
    report["config"] = {"url": args.url, "route": args.route, "clients": args.clients,
                        "duration_s": args.duration, "rate": args.rate, "no_backoff": args.no_backoff,
                        "connections": args.connections, "mix": [asdict(c) for c in args.mix]}
    if args.json == "-":
        json.dump(report, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(format_report(report))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    return 0
