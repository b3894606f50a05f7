"""One /metrics for all workers: `clefcore serve --device cpu,cpu` runs two real worker processes on one port,
and a scrape, whichever worker the kernel hands it to, reports the sum over both (prometheus_client's
multiprocess mode), not the answering worker's own count."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from pathlib import Path

import pytest
from prometheus_client.mmap_dict import MmapedDict, mmap_key

from server_harness import Server, ticket, until

pytestmark = pytest.mark.skipif(not hasattr(socket, "SO_REUSEPORT"),
                                reason="workers share one port through SO_REUSEPORT")

DECIDED = 'route="/v1/systemone",status="200"'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_workers(env: dict | None = None, *args: str) -> Server:
    server = Server("--device", "cpu,cpu", "--spread", "workers", "--port", str(free_port()), *args, env=env)
    server.wait_ready()
    # /health answers from whichever worker takes the connection: wait until both are up and ready.
    until(lambda: server.metric("clef_workers") == 2 and server.metric("clef_ready") == 1, 60, "both workers")
    return server


def worker_pids(server: Server) -> list[int]:
    (supervisor,) = server.events("supervisor")
    return [pid for _, pid in supervisor["workers"]]


def decided_in_file(path: Path) -> float:
    """A worker's own count of answered decisions, read from its counter file."""
    total = 0.0
    for key, value, _, _ in MmapedDict.read_all_values_from_file(str(path)):
        name, sample, labels, _ = json.loads(key)
        if sample == "clef_requests_total" and labels == {"route": "/v1/systemone", "status": "200"}:
            total += value
    return total


def test_a_scrape_sums_over_both_workers(tmp_path):
    metrics_dir = tmp_path / "metrics"
    with two_workers({"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}) as server:
        pids = worker_pids(server)
        assert len(pids) == 2 and server.proc.pid not in pids
        assert server.metric("clef_devices") == 2
        # each worker listens on the one port and logs its own start
        assert {e["pid"] for e in server.events("listening")} == set(pids)
        assert len(server.wait_for_events("ready", lambda events: len(events) >= 2)) == 2
        n = 24
        for i in range(n):  # a new connection each: SO_REUSEPORT spreads them over the workers
            assert server.decide(ticket(f"Checkout error number {i}.")).status == 200
        per_worker = {pid: decided_in_file(metrics_dir / f"counter_{pid}.db") for pid in pids}
        assert all(count > 0 for count in per_worker.values()), per_worker  # both really answered some
        assert sum(per_worker.values()) == n
        for _ in range(8):  # scrapes land on either worker: every one reports the pod's total
            text = server.get("/metrics").text
            assert server.metric("clef_requests_total", DECIDED) == n, text
            assert server.metric("clef_prompt_tokens_total") > 0
            assert 1 <= server.metric("clef_batches_total") <= n
        text = server.get("/metrics").text
        # Summed and min'd gauges come as one series; device memory comes as one series per worker.
        assert sum(line.startswith("clef_queue_depth ") for line in text.splitlines()) == 1
        memory = [line for line in text.splitlines() if line.startswith("clef_device_memory_bytes{")]
        assert {line.split('pid="')[1].split('"')[0] for line in memory} == {str(p) for p in pids}
        assert "clef_precision_fallbacks_total 0.0" in text
        # each worker labels its device's busy time with its place in --device: one series per GPU
        for lane in ("0", "1"):
            assert server.metric("clef_device_busy_seconds_total", f'lane="{lane}"') > 0, text
        assert server.metric("clef_request_duration_seconds_count", 'route="/v1/systemone"') == n
        assert server.terminate() == 0 and len(server.events("exit")) == 2
    # Dead workers' live gauges are gone (they would hold clef_ready and the queue depth); counters stay.
    left = sorted(p.name for p in metrics_dir.iterdir())
    assert not [name for name in left if name.startswith("gauge_live")], left
    assert {f"counter_{pid}.db" for pid in pids} <= set(left)


def test_a_new_run_does_not_count_the_last_ones_files(tmp_path):
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    # What an earlier run in the same directory (an emptyDir across a container restart) left behind.
    stale = MmapedDict(str(metrics_dir / "counter_999999.db"))
    key = mmap_key("clef_requests", "clef_requests_total", ["route", "status"], ["/v1/systemone", "200"],
                   "HTTP requests answered, by route and status")
    stale.write_value(key, 1000.0, 0.0)
    stale.close()
    with two_workers({"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}) as server:
        assert server.decide(ticket("One request.")).status == 200
        assert server.metric("clef_requests_total", DECIDED) == 1
        assert not (metrics_dir / "counter_999999.db").exists()
        assert server.terminate() == 0


def test_the_supervisor_owns_and_removes_its_own_directory(monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    with two_workers() as server:
        (supervisor,) = server.events("supervisor")
        path = Path(supervisor["metrics_dir"])
        assert path.is_dir()
        assert server.decide(ticket("Another request.")).status == 200
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait_exit() == 0
    assert not path.exists()


@pytest.mark.slow
def test_sigterm_under_load_drains_both_workers_and_the_scrape_counts_every_answer(tmp_path):
    """16 keep-alive clients (16 connections, which the kernel spreads over the two workers) for 3 s, then SIGTERM
    to the supervisor: each worker drains its own accepted requests, every request accepted before the signal is
    answered 200, the pod exits 0, and the workers' counter files hold exactly the 200s the clients received."""
    from test_server_load import load, unanswered_before  # the load test's client loop, 32 keep-alive clients

    metrics_dir = tmp_path / "metrics"
    # admission out of the way (test_server_load's drain test likewise): what is drained is a deep queue, not
    # the share of 32 clients that each worker's wait budgets admit
    with two_workers({"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}, "--min-queue-wait", "1000",
                     "--max-queue-wait", "1000") as server:
        pids = worker_pids(server)
        record: list = []

        async def main() -> float:
            task = asyncio.ensure_future(load(server.base, 30.0, record))
            await asyncio.sleep(3.0)
            signalled = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            while server.proc.poll() is None and time.monotonic() - signalled < 40:
                await asyncio.sleep(0.05)
            await task
            return signalled

        signalled = asyncio.run(main())
        before = [r for r in record if r[0] < signalled]
        assert len(before) >= 32, "\n".join(server.lines[-20:])
        assert unanswered_before(record, signalled) == [], unanswered_before(record, signalled)[:5]
        assert all(r[2] in (200, 503) or isinstance(r[2], str) for r in record)
        assert server.proc.returncode == 0, "\n".join(server.lines[-20:])
        assert len(server.events("drained")) == 2 and not server.events("drain_timeout")
        assert sorted(e["code"] for e in server.events("exit")) == [0, 0]
        # counters stay on disk after the workers exit: one file per worker, each answered some, the sum is exact
        per_worker = [decided_in_file(metrics_dir / f"counter_{pid}.db") for pid in pids]
        assert all(count > 0 for count in per_worker), per_worker
        assert sum(per_worker) == sum(1 for r in record if r[2] == 200)
