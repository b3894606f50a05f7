"""Shedding by cost (issue 28), on a real `clefcore serve` with the tiny model on the CPU: short requests that
fit the device are answered while long ones are refused or run beside them, even when the short clients resend
at once after a 429; a burst the device finishes within its budget is answered in full; and SIGTERM under each
client behaviour (polite, open loop, resend at once) answers every request it admitted, then exits 0.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pytest

from server_harness import Server, loadtests, short, ticket


def test_a_burst_of_32_small_requests_from_16_clients_on_an_idle_server_is_answered_in_full():
    # ~140 prompt tokens each: the burst is ~4,500, well under a second of device work
    with Server().wait_ready() as s, ThreadPoolExecutor(16) as pool:
        # each client sends its two one after the other
        pairs = pool.map(lambda n: [s.decide(short(100 * n + i)).status for i in range(2)], range(16))
        statuses = sum(pairs, [])
        assert statuses == [200] * 32, statuses


@pytest.mark.slow
def test_short_requests_that_fit_the_device_are_answered_beside_long_ones_under_a_retry_storm():
    # Chunks of 512 tokens: ~0.2-0.4 s steps here, as 4,096 are ~0.16 s on the H200. 0.3 ms of device time per
    # token on top of the computation keeps the device's pace from following the CPU's other work as much.
    # --min-queue-wait 1: short requests are refused at a second of expected wait, so that the shorts' latency
    # compares the scheduler's order, not how much of the storm admission lets in
    with Server("--chunk-tokens", "512", "--max-queue-wait", "60", "--min-queue-wait", "1",
                env={"CLEFCORE_TEST_TOKEN_DELAY_S": "0.0003"}).wait_ready() as s:
        (warm,) = loadtests(s.base, ["--clients", "2", "--duration", "3", "--mix", "short:1:150"],
                            timeout=120)
        short_tokens = warm["classes"]["short"]["mean_input_tokens"]
        rate = s.metric("clef_device_rate_tokens_per_second")
        # The short requests alone take about a quarter of what the device did: they fit it.
        per_s = max(0.5, round(rate / 4 / short_tokens, 2))
        long, short = loadtests(s.base, ["--clients", "3", "--duration", "15", "--mix", "long:1:3000"],
                                ["--rate", str(per_s), "--clients", "8", "--no-backoff", "--duration", "15",
                                 "--mix", "short:1:150"], timeout=120)
    ls, ss = long["classes"]["long"], short["classes"]["short"]
    summary = (f"device {rate:.0f} tokens/s, shorts {per_s}/s of ~{short_tokens} tokens: short {ss}, "
               f"long {ls}, busy {short['device_busy_fraction']}")
    print("\n" + summary)
    assert ss["answered_share"] >= 0.9, summary          # attempts, the at-once resends included
    assert ls["ok"] >= 1, summary                         # the long clients ran
    assert ss["p50_ms"] <= 0.25 * ls["p50_ms"], summary
    assert 0.0 < short["device_busy_fraction"] <= 1.05, summary


BEHAVIOURS = {
    "polite": dict(backoff=True, rate=None),       # waits Retry-After (at most 1 s) after a 429/503
    "open_loop": dict(backoff=True, rate=12.0),    # a request every 1/12 s whatever happens
    "resend_at_once": dict(backoff=False, rate=None),
}


def body(n: int) -> dict:
    state = f"request {n}: checkout error on node {n % 7}"
    if n % 5 == 0:  # a fifth of them long (~1,900 tokens): over capacity, so some are refused
        state = " ".join(f"node {i} reports checkout error {n};" for i in range(100))
    return ticket(state)


async def drive(base: str, behaviour: dict, stop_at: float, record: list) -> None:
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(base, timeout=timeout) as http:
        async def one(n: int) -> tuple[int | str, float]:
            sent = time.monotonic()
            try:
                async with http.post("/v1/systemone", json=body(n)) as reply:
                    await reply.read()
                    record.append((sent, reply.status))
                    return reply.status, float(reply.headers.get("Retry-After", "0") or 0)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as error:
                record.append((sent, type(error).__name__))
                return type(error).__name__, 0.1

        async def client(c: int) -> None:
            n = c
            while time.monotonic() < stop_at:
                status, wait = await one(n)
                n += 8
                if isinstance(status, str) or (behaviour["backoff"] and status in (429, 503)):
                    await asyncio.sleep(min(wait, 1.0))

        if behaviour["rate"] is None:
            await asyncio.gather(*(client(c) for c in range(8)))
            return
        tasks, n = [], 0
        while time.monotonic() < stop_at:
            tasks.append(asyncio.ensure_future(one(n)))
            n += 1
            await asyncio.sleep(1.0 / behaviour["rate"])
        await asyncio.gather(*tasks)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BEHAVIOURS))
def test_sigterm_under_each_client_behaviour_answers_every_admitted_request_and_exits_0(name):
    # --min-queue-wait 1: what admission lets in under these storms drains well within the shutdown timeout
    with Server("--chunk-tokens", "512", "--shutdown-timeout", "20", "--min-queue-wait", "1") as s:
        s.wait_ready()
        record: list = []

        async def main() -> float:
            task = asyncio.ensure_future(drive(s.base, BEHAVIOURS[name], time.monotonic() + 8.0, record))
            await asyncio.sleep(4.0)
            signalled = time.monotonic()
            s.proc.send_signal(15)
            await task
            return signalled

        signalled = asyncio.run(main())
        code = s.wait_exit(30)
    before = [status for sent, status in record if sent < signalled]
    answered = sum(1 for status in before if status == 200)
    assert answered >= 1 and set(before) <= {200, 429, 503}, sorted(set(map(str, before)))
    requests = [e for e in s.events("request") if e["path"] == "/v1/systemone"]
    # Whatever the server took in was answered: no timeouts or failures, and every 200 it sent arrived. A 503
    # is a request that came after the signal (draining), never one it had admitted.
    assert all(e["status"] in (200, 503) for e in requests), [e for e in requests if e["status"] != 200]
    assert all(e.get("error") in (None, "unavailable_error") for e in requests)
    assert sum(e["status"] == 200 for e in requests) == sum(status == 200 for _, status in record)
    assert s.events("drained") and not s.events("drain_timeout")
    assert code == 0
