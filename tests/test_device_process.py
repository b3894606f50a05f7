"""The model's own process (server/device_process.py) on the CPU with the tiny golden checkpoint: calls answered
in order with the engine's status, chunk steps that add up to the whole forward's answer, errors that cross the
pipe whole, and a device process that dies failing its waiting calls instead of leaving them hanging."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import sys
import time
import numpy as np
import pytest

import clefcore
from clefcore.errors import ContextLengthError, DeviceError, GuardError, RequestError
from clefcore.example_request import support_ticket
from clefcore.options import EngineOptions
from clefcore.server.device_process import DeviceProcess
from clefcore.server.testhooks import TestHooks
from server_harness import MODEL, Server, ticket, until

RESERVE = {"batch_tokens": 16384, "batch_requests": 32, "chunk_tokens": 4096}   # the serve defaults
NO_HOOKS = TestHooks(fail_marker=None, batch_delay_s=0.0, load_delay_s=0.0)


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


def probabilities(response: dict) -> np.ndarray:
    return np.array([p for a in response["answers"].values()
                     for p in (list(a["probabilities"].values()) if "probabilities" in a else [a["noul"]])])


@pytest.mark.parametrize("error", [ContextLengthError("too long", required=70, maximum=64),
                                   RequestError("bad", field="questions.a", limit="8 questions"),
                                   GuardError("layer 3: NaN", what="layer 3")])
def test_clef_errors_keep_their_fields_through_pickle(error):
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and back.message == error.message and str(back) == str(error)
    assert back.__dict__ == error.__dict__


def test_calls_are_answered_with_the_engine_status_and_chunks_add_up():
    engine = clefcore.load(MODEL)
    short = engine.prepare(support_ticket(state="Short one."))
    long = engine.prepare(support_ticket(state="A longer state. " * 40))
    assert long.num_tokens > 3 * 16 + 1                  # several chunks of 16, and a last one that is not full
    whole = engine.infer([short, long])

    async def main():
        device = DeviceProcess(NO_HOOKS)
        try:
            status = await device.load(str(MODEL), None, "cpu", EngineOptions(), RESERVE)
            assert (status.model_name, status.device, status.mode) == (engine.model_name, "cpu", "fp32")
            assert status.images_refused == engine.images_refused and status.fallbacks == 0
            await device.self_check()
            results, seconds = await device.infer([short, long])
            assert seconds > 0 and [e for _, e in results] == [None, None]
            steps = [await device.step(long, 16)]
            while not steps[-1].done:
                steps.append(await device.step(None, 16))
            assert [s.error for s in steps] == [None] * len(steps)
            assert sum(s.tokens for s in steps) == long.num_tokens and steps[-1].tokens_left == 0
            assert len(steps) == -(-long.num_tokens // 16)
            # each step as long as the server asks (its auto size follows the rate)
            sized = [await device.step(long, 10)]
            sized.append(await device.step(None, 30))
            assert [s.tokens for s in sized] == [10, 30] and sized[-1].tokens_left == long.num_tokens - 40
            # the rate at start: a forward of about the tokens asked, timed warm
            tokens, seconds = await device.measure(1_000)
            assert tokens == 1_000 and seconds > 0
            # a new prompt replaces a run that was left (its client gone), and drop frees one
            await device.step(long, 16)
            await device.drop()
            return results, steps[-1].response
        finally:
            await device.stop()

    results, chunked = run(main())
    for (response, _), expected in zip(results, whole):
        np.testing.assert_allclose(probabilities(response), probabilities(expected), rtol=0, atol=1e-6)
    np.testing.assert_allclose(probabilities(chunked), probabilities(whole[1]), rtol=0, atol=1e-4)


def test_a_failing_request_fails_alone_and_a_load_error_arrives_whole():
    hooks = TestHooks(fail_marker="BOOM", batch_delay_s=0.0, load_delay_s=0.0)

    async def main():
        device = DeviceProcess(hooks)
        try:
            with pytest.raises(clefcore.CheckpointError) as missing:
                await device.load("/nonexistent/model", None, "cpu", EngineOptions(), RESERVE)
            await device.load(str(MODEL), None, "cpu", EngineOptions(), RESERVE)
            engine = clefcore.load(MODEL)
            good, bad = (engine.prepare(support_ticket(state=s)) for s in ("Fine.", "It went BOOM."))
            results, _ = await device.infer([good, bad, good])
            return missing.value, results
        finally:
            await device.stop()

    missing, results = run(main())
    assert "/nonexistent/model" in missing.message
    assert results[0][1] is None and results[2][1] is None and results[0][0] == results[2][0]
    assert results[1][0] is None and isinstance(results[1][1], DeviceError)
    assert "injected device fault" in results[1][1].message


def test_a_device_process_that_dies_fails_its_waiting_calls():
    hooks = TestHooks(fail_marker=None, batch_delay_s=30.0, load_delay_s=0.0)   # every forward sleeps 30 s
    lost: list[str] = []

    async def main():
        device = DeviceProcess(hooks)
        device.on_lost = lost.append
        try:
            await device.load(str(MODEL), None, "cpu", EngineOptions(), RESERVE)
            prepared = clefcore.load(MODEL).prepare(support_ticket())
            waiting = asyncio.ensure_future(device.infer([prepared]))
            await asyncio.sleep(0.5)
            os.kill(device._process.pid, signal.SIGKILL)
            started = time.monotonic()
            with pytest.raises(DeviceError) as first:
                await waiting
            took = time.monotonic() - started
            with pytest.raises(DeviceError) as later:
                await device.infer([prepared])
            return first.value, later.value, took
        finally:
            await device.stop()

    first, later, took = run(main())
    assert took < 5 and "device process exited" in first.message and str(-signal.SIGKILL) in first.message
    assert later.message == first.message and lost == [first.message]


def test_the_sticky_hook_breaks_every_later_call_as_a_dead_cuda_context_would():
    hooks = TestHooks(fail_marker=None, batch_delay_s=0.0, load_delay_s=0.0, sticky_marker="XID")

    async def main():
        device = DeviceProcess(hooks)
        try:
            await device.load(str(MODEL), None, "cpu", EngineOptions(), RESERVE)
            engine = clefcore.load(MODEL)
            good, poison = (engine.prepare(support_ticket(state=s)) for s in ("Fine.", "Xid 13 on the card: XID"))
            before, _ = await device.infer([good])
            await device.self_check()
            struck, _ = await device.infer([good, poison])
            after, _ = await device.infer([good])
            step = await device.step(good, 16)
            with pytest.raises(DeviceError) as check:
                await device.self_check()
            return before, struck, after, step, check.value
        finally:
            await device.stop()

    before, struck, after, step, check = run(main())
    assert before[0][1] is None
    # the batch that carried it: retried request by request, and by then the good one fails too
    assert [type(e) for _, e in struck + after] == [DeviceError] * 3 and isinstance(step.error, DeviceError)
    assert "sticky" in check.message


def test_kill_fails_the_waiting_calls_with_its_reason_without_calling_on_lost():
    hooks = TestHooks(fail_marker=None, batch_delay_s=30.0, load_delay_s=0.0)   # every forward sleeps 30 s
    lost: list[str] = []

    async def main():
        device = DeviceProcess(hooks)
        device.on_lost = lost.append
        try:
            await device.load(str(MODEL), None, "cpu", EngineOptions(), RESERVE)
            prepared = clefcore.load(MODEL).prepare(support_ticket())
            waiting = asyncio.ensure_future(device.infer([prepared]))
            await asyncio.sleep(0.5)
            os.kill(device._process.pid, signal.SIGSTOP)     # it no longer answers, as a wedged device would not
            assert device.lost is None
            device.kill("given up")
            with pytest.raises(DeviceError) as failed:
                await waiting
            await asyncio.sleep(0.5)                         # the pipe's EOF arrives meanwhile: no loss reported
            return failed.value, device.lost, device._process.exitcode
        finally:
            await device.stop()

    failed, reason, code = run(main())
    assert failed.message == reason == "given up" and lost == [] and code == -signal.SIGKILL


def test_the_device_process_ignores_sigint_and_ends_with_the_pipe():
    async def main():
        device = DeviceProcess(NO_HOOKS)
        await device.load(str(MODEL), None, "cpu", EngineOptions(), RESERVE)
        pid = device._process.pid
        os.kill(pid, signal.SIGINT)          # Ctrl-C reaches the whole process group; the server drains first
        os.kill(pid, signal.SIGTERM)
        await asyncio.sleep(0.3)
        alive = device._process.is_alive()
        started = time.monotonic()
        await device.stop()
        return alive, time.monotonic() - started, device._process.exitcode

    alive, took, code = run(main())
    assert alive and took < 3 and code == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the server's child")
def test_a_server_whose_device_process_dies_under_load_answers_everything_and_exits_non_zero():
    """kill -KILL under load: the request on the device gets 500, the queued ones (they never reached it) 503
    with Retry-After, no connection is dropped, and the server exits 1 so that it is restarted."""
    from concurrent.futures import ThreadPoolExecutor

    server = Server("--max-batch-requests", "1", "--min-queue-wait", "1000",
                    env={"CLEFCORE_TEST_BATCH_DELAY_S": "0.5"}).wait_ready()
    try:
        with ThreadPoolExecutor(5) as pool:
            replies = [pool.submit(server.decide, ticket(f"under load {i}")) for i in range(5)]
            until(lambda: server.metric("clef_queue_depth") == 4, 10, "four queued requests")
            os.kill(server.device_pid(), signal.SIGKILL)
            replies = [reply.result(30) for reply in replies]   # an OSError here: a dropped connection
        assert server.wait_exit(30) == 1
        assert sorted(r.status for r in replies) == [500, 503, 503, 503, 503], replies
        for reply in replies:
            if reply.status == 500:
                assert reply.json()["error"]["type"] == "device_error"
            else:
                assert reply.json()["error"]["type"] == "unavailable_error" and int(reply.headers["retry-after"]) >= 1
                assert "device process exited" in reply.json()["error"]["message"]
        assert server.events("device_lost") and server.events("exit")[0]["code"] == 1
    finally:
        server.kill()
