"""One server process, two device processes: `clefcore serve --device cpu,cpu` (``--spread queue``, the default
for several devices) drives both from one queue, so a few keep-alive connections keep both devices busy (the
kernel's SO_REUSEPORT spreading of connections would pin each to one worker), /metrics says what each device
ran, and SIGTERM under load drains both with nothing lost."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from server_harness import Server, until

BATCH_DELAY_S = 0.2   # every forward sleeps this long in its device process: device time the counters must see
BUSY = "clef_device_busy_seconds_total"


def lanes_busy(server: Server) -> dict[str, float]:
    """Each lane's busy seconds, from /metrics."""
    busy = {}
    for line in server.get("/metrics").text.splitlines():
        if line.startswith(BUSY + '{lane="'):
            busy[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return busy


def test_four_keep_alive_clients_keep_both_devices_busy():
    """4 keep-alive clients, 2 requests a forward at most: one server process, both device processes ran
    forwards, at the same time (the pod's busy seconds exceed the wall time), every request answered 200, and
    the lanes' busy seconds sum to at least the forwards' own device time."""
    from test_server_load import client_loop

    # admission out of the way: this test wants every request answered
    with Server("--device", "cpu,cpu", "--max-batch-requests", "2", "--min-queue-wait", "1000",
                "--max-queue-wait", "1000", env={"CLEFCORE_TEST_BATCH_DELAY_S": str(BATCH_DELAY_S)}) as s:
        s.wait_ready()
        assert s.get("/health").json()["device"] == "cpu,cpu"
        assert s.metric("clef_workers") == 1 and s.metric("clef_devices") == 2
        assert not s.events("supervisor")                     # no worker processes: one server
        busy_before, batches_before = lanes_busy(s), s.metric("clef_batches_total")
        assert set(busy_before) == {"0", "1"}
        record: list = []

        async def main() -> float:
            started = time.monotonic()
            stop_at = started + 4.0
            await asyncio.gather(*(client_loop(s.base, c, stop_at, record) for c in range(4)))
            return time.monotonic() - started

        seconds = asyncio.run(main())
        busy = {lane: value - busy_before[lane] for lane, value in lanes_busy(s).items()}
        batches = s.metric("clef_batches_total") - batches_before
        print(f"\n4 keep-alive clients, {seconds:.1f} s: {len(record)} requests, {batches:.0f} forwards, busy s by "
              f"lane {({lane: round(value, 2) for lane, value in busy.items()})}")
        assert len(record) >= 8 and all(r[2] == 200 for r in record), [r for r in record if r[2] != 200][:5]
        assert all(value >= 0.25 * sum(busy.values()) for value in busy.values()), busy
        assert sum(busy.values()) > 1.2 * seconds, (busy, seconds)          # the two ran side by side
        assert sum(busy.values()) >= BATCH_DELAY_S * batches, (busy, batches)
        assert s.metric(BUSY) == pytest.approx(sum(lanes_busy(s).values()))   # the sum: the pod's device time
        assert s.metric("clef_requests_total", 'status="200"') >= len(record)
        text = s.get("/metrics").text                                      # one memory series per device
        assert {line.split('lane="')[1].split('"')[0] for line in text.splitlines()
                if line.startswith("clef_device_memory_bytes{")} == {"0", "1"}, text
        assert s.terminate() == 0


@pytest.mark.slow
def test_sigterm_under_load_drains_both_devices_and_loses_nothing():
    """32 keep-alive clients for 3 s, then SIGTERM: every request sent before the signal is answered 200, one
    drain, exit 0, and the server logged exactly the 200s the clients received."""
    from test_server_load import load

    with Server("--device", "cpu,cpu", "--shutdown-timeout", "15", "--max-queue", "256", "--min-queue-wait",
                "1000", "--max-queue-wait", "1000", env={"CLEFCORE_TEST_BATCH_DELAY_S": "0.05"}) as s:
        s.wait_ready()
        record: list = []

        async def main() -> tuple[float, dict]:
            task = asyncio.ensure_future(load(s.base, 30.0, record))
            await asyncio.sleep(3.0)
            busy = lanes_busy(s)
            signalled = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            while s.proc.poll() is None and time.monotonic() - signalled < 30:
                await asyncio.sleep(0.05)
            await task
            return signalled, busy

        signalled, busy = asyncio.run(main())
        assert s.wait_exit() == 0, "\n".join(s.lines[-20:])
        assert all(value > 0 for value in busy.values()) and len(busy) == 2, busy   # both devices ran
        before = [r for r in record if r[0] < signalled]
        assert len(before) >= 32, "\n".join(s.lines[-20:])
        assert all(r[2] == 200 for r in before), [r for r in before if r[2] != 200][:5]
        assert all(r[2] in (200, 503) or isinstance(r[2], str) for r in record)
        assert len(s.events("drained")) == 1 and not s.events("drain_timeout")
        assert [e["code"] for e in s.events("exit")] == [0]
        logged = [e for e in s.events("request") if e.get("route") == "/v1/systemone" and e["status"] == 200]
        assert len(logged) == sum(1 for r in record if r[2] == 200)


def test_each_device_process_is_spawned_seeing_only_its_own_gpu(monkeypatch):
    """What spawn copies into a device process (or a worker) for each device: its GPU alone, as cuda:0; the
    server's own environment comes back as it was."""
    from clefcore.server import gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    with gpus.alone("cuda:1") as loads_as:
        assert loads_as == "cuda:0" and os.environ["CUDA_VISIBLE_DEVICES"] == "5"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3,5"
    with gpus.alone("cpu") as loads_as:
        assert loads_as == "cpu" and os.environ["CUDA_VISIBLE_DEVICES"] == "3,5"
    with pytest.raises(ValueError, match="cuda:2: CUDA_VISIBLE_DEVICES=3,5 shows only 2 GPU"):
        with gpus.alone("cuda:2"):
            pass
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with gpus.alone("cuda:2") as loads_as:
        assert loads_as == "cuda:0" and os.environ["CUDA_VISIBLE_DEVICES"] == "2"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_the_pods_status_names_the_devices_and_sums_fallbacks_and_memory():
    from clefcore.engine import EngineStatus
    from clefcore.server.engine_status import combined

    first = EngineStatus("clef-flash", "cuda:0", "fast", None, {"cublas": True}, 2, 5_000)
    second = EngineStatus("clef-flash", "cuda:0", "fast", None, {"cublas": True}, 1, 7_000)
    assert combined([first]) is first and combined([first], "cuda:0,cuda:1") is first   # one: as it is
    pod = combined([first, second], "cuda:0,cuda:1")
    assert (pod.model_name, pod.device, pod.mode, pod.backend) == ("clef-flash", "cuda:0,cuda:1", "fast",
                                                                   {"cublas": True})
    assert (pod.fallbacks, pod.memory_in_use) == (3, 12_000)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the server's children")
def test_one_dead_device_process_fails_the_whole_server():
    """A pod missing a GPU is restarted whole: one of the two device processes killed, the server logs
    device_lost and exits 1, and the other device process ends with it."""
    with Server("--device", "cpu,cpu").wait_ready() as s:
        devices = s.device_pids()
        assert len(devices) == 2
        os.kill(devices[0], signal.SIGKILL)
        assert s.wait_exit(30) == 1
        assert s.events("device_lost") and [e["code"] for e in s.events("exit")] == [1]
        until(lambda: ended(devices[1]), 10, "the other device process's end")


def ended(pid: int) -> bool:
    """Gone, or a zombie that no one has reaped yet (a container's first process may not)."""
    try:
        return "(zombie)" in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
