"""`clefcore loadtest`: the mix parser and the report's arithmetic, then a short run of each mode against a
real server (what it counts must match what the server counted)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import pytest

from clefcore.loadtest import (Record, RequestClass, Run, _refusal_reason, format_report, parse_mix,
                               percentile, summarize)
from server_harness import Server, loadtests


def test_parse_mix_normalises_shares_and_names_bad_parts():
    mix = parse_mix("short:8:1200, long:2:24576")
    assert [(c.name, c.tokens) for c in mix] == [("short", 1200), ("long", 24576)]
    assert [round(c.share, 6) for c in mix] == [0.8, 0.2]
    for bad, words in [("short:0.8", "name:share:tokens"), ("a:x:3", "share must be a number"),
                       ("a:1:0", "tokens >= 1"), ("a:-1:5", "share must be > 0"),
                       ("a:1:5,a:1:6", "named twice")]:
        with pytest.raises(ValueError, match=words):
            parse_mix(bad)


def test_percentiles_and_report_by_class():
    assert percentile([5, 1, 3, 2, 4], 50) == 3
    assert percentile([5, 1, 3, 2, 4], 99) == 5
    assert percentile(list(range(1, 101)), 90) == 90
    classes = [RequestClass("short", 0.5, 100), RequestClass("long", 0.5, 1000)]
    records = [Record("short", 200, 0.1 * i, 100) for i in range(1, 11)]
    records += [Record("long", 200, 2.0, 1000), Record("long", 429, 0.004, reason="queued_work"),
                Record("long", 429, 0.006, reason="queued_work"), Record("long", 429, 1.5, reason="evicted"),
                Record("short", "ClientOSError", 0.0)]
    report = summarize(Run(records, started=0.0, ended=2.0, busy_s=1.5), classes)
    assert report["requests"] == 15 and report["ok"] == 11 and report["device_busy_fraction"] == 0.75
    assert report["requests_per_s"] == 5.5 and report["prompt_tokens_per_s"] == 1000.0
    assert report["classes"]["short"]["p50_ms"] == 500.0 and report["classes"]["short"]["p99_ms"] == 1000.0
    assert report["classes"]["long"]["sent"] == 4 and report["classes"]["long"]["mean_input_tokens"] == 1000.0
    assert report["classes"]["short"]["answered_share"] == round(10 / 11, 4)
    assert report["classes"]["long"]["answered_share"] == round(1 / 4, 4)
    assert report["classes"]["long"]["ok_per_s"] == 0.5
    assert summarize(Run(records, started=0.0, ended=2.0), classes)["device_busy_fraction"] is None
    assert report["device_busy_by_lane"] is None                   # one device, or workers: no split
    two = summarize(Run(records, started=0.0, ended=2.0, busy_s=1.5, lanes_busy_s={"0": 1.8, "1": 1.2}), classes)
    assert two["device_busy_by_lane"] == {"0": 0.9, "1": 0.6}
    assert "device busy 75.0%, device 0 90.0%, device 1 60.0%" in format_report(two)
    assert report["non_200"] == {"429": 3, "ClientOSError": 1}
    assert report["refused_p50_ms"] == 6.0 and report["refused_p99_ms"] == 1500.0
    # an eviction waited in the queue: its latency is apart from the refusals made on arrival
    assert report["refused_by_reason"] == {"evicted": {"count": 1, "p50_ms": 1500.0, "p99_ms": 1500.0},
                                           "queued_work": {"count": 2, "p50_ms": 4.0, "p99_ms": 6.0}}
    assert "queued_work 2: p50 4.0 ms, p99 6.0 ms" in format_report(report)
    # which class the slow 429s came from
    assert report["classes"]["long"]["refused"] == 3 and report["classes"]["long"]["refused_p99_ms"] == 1500.0
    assert report["classes"]["short"]["refused"] == 0 and report["classes"]["short"]["refused_p99_ms"] is None
    assert "429 3: p99 1500.0 ms" in format_report(report)
    assert report["loop_lag"] == {"client": None, "server": None}
    assert report["offered_requests_per_s"] is None                # no offered time: not judged


def test_what_was_answered_while_load_was_offered_leaves_the_drain_out():
    classes = [RequestClass("only", 1.0, 100)]
    # load offered for 10 s; 8 answers within it, 4 more while the queue drained, until 13 s
    records = [Record("only", 200, 1.0, 100, done_at=100.0 + t) for t in (1, 2, 3, 4, 5, 6, 7, 10)]
    records += [Record("only", 200, 3.0, 100, done_at=100.0 + t) for t in (10.5, 11, 12, 13)]
    report = summarize(Run(records, started=100.0, offered_s=10.0, ended=113.0), classes)
    assert report["requests_per_s"] == round(12 / 13, 3) and report["prompt_tokens_per_s"] == round(1200 / 13, 1)
    assert report["offered_requests_per_s"] == 0.8 and report["offered_prompt_tokens_per_s"] == 80.0
    assert "while offered (10.0 s): 0.8 req/s, 80.0 prompt tokens/s" in format_report(report)


def test_the_report_gives_both_sides_event_loop_lag():
    """The client's own samples as percentiles; the server's histogram deltas as the bucket bound under which
    50 % and 99 % fell and the share over 50 ms (None: past the last finite bound)."""
    classes = [RequestClass("only", 1.0, 100)]
    lag = [0.001] * 98 + [0.030, 0.400]
    server = {0.001: 50.0, 0.005: 90.0, 0.05: 99.0, 0.1: 100.0, 2.5: 100.0, float("inf"): 100.0}
    report = summarize(Run([Record("only", 429, 0.003, reason="queued_work")], started=0.0, ended=1.0,
                           client_lag_s=lag, server_lag=server), classes)
    assert report["loop_lag"]["client"] == {"p50_ms": 1.0, "p99_ms": 30.0, "max_ms": 400.0}
    assert report["loop_lag"]["server"] == {"samples": 100, "p50_ms_at_most": 1.0, "p99_ms_at_most": 50.0,
                                            "over_50ms_share": 0.01}
    assert "event-loop lag: client p50 1.0 ms, p99 30.0 ms, max 400.0 ms; server p99 <= 50.0 ms, 1.00% over 50 ms" \
        in format_report(report)
    tail = summarize(Run([], started=0.0, ended=1.0, client_lag_s=[0.0], server_lag={
        0.05: 10.0, 2.5: 10.0, float("inf"): 20.0}), classes)["loop_lag"]["server"]
    assert tail == {"samples": 20, "p50_ms_at_most": 50.0, "p99_ms_at_most": None, "over_50ms_share": 0.5}


def test_a_refusals_reason_comes_from_its_bare_body():
    assert _refusal_reason(b'{"error": {"type": "rate_limit_error", "reason": "evicted"}}') == "evicted"
    for other in (b'{"errors": [{"code": 3040}]}', b"not json", b'["a list"]', b'{"error": "text"}'):
        assert _refusal_reason(other) == "unknown"


def loadtest(url: str, *args: str) -> dict:
    return loadtests(url, list(args), timeout=60)[0]


def test_closed_loop_and_fixed_rate_against_a_server():
    with Server("--max-queue-wait", "30", "--min-queue-wait", "1000").wait_ready() as s:
        closed = loadtest(s.base, "--route", "workers-ai", "--clients", "4", "--duration", "1.5",
                          "--mix", "short:0.5:200,long:0.5:500")
        assert closed["non_200"] == {}
        # the server also answered the two sizing probes, which the report does not count
        assert closed["ok"] + 2 == s.metric("clef_requests_total", "/ai/run/") > 2
        assert sum(c["sent"] for c in closed["classes"].values()) == closed["requests"]
        short, long = closed["classes"]["short"], closed["classes"]["long"]
        assert short["p50_ms"] <= short["p90_ms"] <= short["p99_ms"]
        # the probes measured this tokenizer (the tiny model's splits the words in ~2 tokens each), so a
        # class's bodies land near its size; the short class asks for less than the fixed part alone
        sizing = closed["sizing"]
        assert sizing["measured"] and 1.5 < sizing["per_word"] < 5 and sizing["fixed"] > 100
        assert abs(long["mean_input_tokens"] - 500) < 40
        assert short["mean_input_tokens"] < sizing["fixed"] + 10
        fixed = loadtest(s.base, "--rate", "8", "--duration", "1", "--clients", "16", "--mix", "only:1:200")
        assert 6 <= fixed["requests"] <= 10 and fixed["ok"] == fixed["requests"]
        assert fixed["ok"] + 2 == s.metric("clef_requests_total", "/v1/systemone")


def test_no_backoff_resends_at_once_and_the_busy_fraction_comes_from_the_server():
    # One queued request at most and 0.2 s per batch: most requests are refused (queue_full) at first.
    with Server("--max-queue", "1", env={"CLEFCORE_TEST_BATCH_DELAY_S": "0.2"}).wait_ready() as s:
        busy_before = s.metric("clef_device_busy_seconds_total")
        # at a fixed rate the refused request itself is sent again until admitted (or the run ends): of the 8,
        # about one per batch is answered, after many refused attempts
        fixed = loadtest(s.base, "--rate", "8", "--duration", "1", "--clients", "8", "--no-backoff",
                         "--mix", "only:1:200")
        only = fixed["classes"]["only"]
        assert fixed["config"]["no_backoff"] and set(fixed["non_200"]) <= {"429"}, fixed["non_200"]
        assert fixed["non_200"]["429"] >= 5 and only["sent"] == only["ok"] + fixed["non_200"]["429"]
        assert 2 <= only["ok"] <= 8 and only["answered_share"] < 0.5
        # a closed-loop client sends its next request at once after a 429: far more attempts than answers
        closed = loadtest(s.base, "--clients", "4", "--duration", "1", "--no-backoff", "--mix", "only:1:200")
        assert closed["non_200"]["429"] > 4 * closed["ok"] > 0
        busy = s.metric("clef_device_busy_seconds_total") - busy_before
        # each report's share of the server's busy seconds: about 0.2 s a batch, the device mostly busy
        assert 0.5 < fixed["device_busy_fraction"] <= 1.05 and 0.5 < closed["device_busy_fraction"] <= 1.05
        assert busy >= 0.2 * (only["ok"] + closed["ok"])
        # both loops sampled every 20 ms over the run (the server's between the report's two scrapes, which
        # also take in the tail of requests in flight at the end)
        lag = closed["loop_lag"]
        assert len(lag) == 2 and lag["client"]["max_ms"] >= lag["client"]["p50_ms"] >= 0
        assert 10 <= lag["server"]["samples"] <= (closed["duration_s"] + 1) / 0.02, lag


def test_one_process_on_two_devices_reports_each_ones_busy_fraction():
    # 4 clients, one request a forward, 0.2 s each: both devices of `--device cpu,cpu` mostly busy
    with Server("--device", "cpu,cpu", "--max-batch-requests", "1", "--min-queue-wait", "1000",
                "--max-queue-wait", "1000", env={"CLEFCORE_TEST_BATCH_DELAY_S": "0.2"}).wait_ready() as s:
        report = loadtest(s.base, "--clients", "4", "--duration", "2", "--mix", "only:1:200")
        lanes = report["device_busy_by_lane"]
        assert set(lanes) == {"0", "1"} and all(0.5 < share <= 1.05 for share in lanes.values()), lanes
        # the mean over the devices is the pod's busy fraction
        assert report["device_busy_fraction"] == pytest.approx(sum(lanes.values()) / 2, abs=0.002)
        assert f"device 0 {lanes['0']:.1%}, device 1 {lanes['1']:.1%}" in format_report(report)


class _CountingServer:
    """A stand-in for the server in a thread of its own: answers /v1/systemone with a token count that grows
    with the state's words (so the probes calibrate), and records each request's client port: one port per
    TCP connection."""

    def __init__(self):
        self.ports: list[int] = []
        self.ready = threading.Event()

    def __enter__(self):
        threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True).start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.stop.set)

    async def _serve(self):
        from aiohttp import web

        async def decide(request):
            body = await request.json()
            self.ports.append(request.transport.get_extra_info("peername")[1])
            return web.json_response({"usage": {"input_tokens": 20 + len(body["state"].split())}})
        app = web.Application()
        app.router.add_post("/v1/systemone", decide)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        self.loop, self.stop = asyncio.get_running_loop(), asyncio.Event()
        self.ready.set()
        await self.stop.wait()
        await runner.cleanup()


@pytest.mark.parametrize("connections", ["keep-alive", "new"])
def test_connections_are_kept_alive_or_new_per_request(connections):
    """Issue 31 measures both: keep-alive clients stay on their connection (SO_REUSEPORT pins each to one
    worker), new connections spread request by request."""
    with _CountingServer() as s:
        report = loadtest(s.url, "--clients", "3", "--duration", "0.5", "--mix", "only:1:50",
                          "--connections", connections)
    assert report["config"]["connections"] == connections and report["ok"] > 20
    if connections == "new":
        assert len(set(s.ports)) == len(s.ports)           # every request on a connection of its own
    else:
        assert len(set(s.ports)) <= 3 + 2                  # the clients' connections, and the two probes' at most


def test_a_given_sizing_replaces_the_probes():
    """A run that starts beside another one's load takes the sizing an earlier report gave: no probe is sent,
    and states are sized with it (the stand-in counts 20 + one token a word, as --sizing 20:1 says)."""
    with _CountingServer() as s:
        report = loadtest(s.url, "--clients", "1", "--duration", "0.3", "--mix", "only:1:50",
                          "--sizing", "20:1")
    assert report["sizing"] == {"fixed": 20.0, "per_word": 1.0, "measured": False}
    assert report["ok"] == len(s.ports) > 0                 # every request the server saw was the load's own
    assert report["classes"]["only"]["mean_input_tokens"] == 50
    for bad in ("20", "20:0", "x:1", "-1:2"):
        refused = subprocess.run([sys.executable, "-m", "clefcore.cli", "loadtest", "--sizing", bad],
                                 capture_output=True, text=True, timeout=60, cwd="/")
        assert refused.returncode == 2 and "--sizing" in refused.stderr, (bad, refused.stderr)
