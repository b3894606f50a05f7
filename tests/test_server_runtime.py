"""The server under concurrency and faults: batching, 429 backpressure, deadlines, 503 while loading and
draining, device-failure isolation, client disconnects, a failed load.

The test hooks (server/testhooks.py) slow the device step or make it fail for a marked request, so every
situation is produced on purpose instead of hoped for."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from server_harness import SUPPORT_TICKET, Server, check_client_rules, same_answers, ticket, until


def concurrently(fn, items):
    with ThreadPoolExecutor(max_workers=len(items)) as pool:
        return list(pool.map(fn, items))


def test_concurrent_requests_are_batched_and_answer_like_single_requests(engine):
    bodies = [ticket(f"Ticket {i}: checkout fails with error {i * 7} for customers in region {i}.")
              for i in range(16)]
    # admission by the wait budget alone (the hook makes the device slow; this tests batching, not refusals)
    with Server("--max-batch-requests", "16", "--min-queue-wait", "1000",
                env={"CLEFCORE_TEST_BATCH_DELAY_S": "0.3"}).wait_ready() as s:
        s.decide(SUPPORT_TICKET)  # occupies the device so that the next ones queue up together
        replies = concurrently(s.decide, bodies)
        for body, reply in zip(bodies, replies):
            assert reply.status == 200, reply
            check_client_rules(body, reply.json())
            assert same_answers(reply.json(), engine.decide(body)), body["state"]
        batches = s.metric("clef_batches_total")
        assert batches < 1 + len(bodies)
        single = s.metric("clef_batch_size_requests_bucket", 'le="1.0"')
        assert s.metric("clef_batch_size_requests_count") - single >= 1, "no batch held several requests"
        assert s.metric("clef_batch_size_tokens_sum") > 0
        lines = [e for e in s.wait_for_events("request", lambda ev: len(ev) >= len(bodies) + 2)
                 if e["path"] == "/v1/systemone"]
        assert max(e["batch_requests"] for e in lines) > 1


def test_full_queue_answers_429_with_retry_after():
    with Server("--max-queue", "2", "--max-batch-requests", "1",
                env={"CLEFCORE_TEST_BATCH_DELAY_S": "0.4"}).wait_ready() as s:
        replies = concurrently(s.decide, [ticket(f"state {i}") for i in range(10)])
        statuses = [r.status for r in replies]
        assert set(statuses) <= {200, 429}, statuses
        assert statuses.count(429) >= 1 and statuses.count(200) >= 3, statuses
        refused = next(r for r in replies if r.status == 429)
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert refused.json()["error"]["limit"] == "2 queued requests"
        cf = concurrently(lambda i: s.post("/client/v4/accounts/a/ai/run/@cf/cloudflare/clef",
                                           ticket(f"cf {i}", model="clef")), range(10))
        limited = [r for r in cf if r.status == 429]
        assert limited and limited[0].json()["errors"][0]["code"] == 3040
        assert s.decide(SUPPORT_TICKET).status == 200


def test_request_past_its_deadline_gets_503_timeout():
    # One request per 1 s forward: of four sent together, the third and fourth cannot finish within 2.5 s.
    with Server("--request-timeout", "2.5", "--max-batch-requests", "1",
                env={"CLEFCORE_TEST_BATCH_DELAY_S": "1.0"}).wait_ready() as s:
        replies = concurrently(s.decide, [ticket(f"deadline {i}") for i in range(4)])
        timed_out = [r for r in replies if r.status == 503]
        assert len(timed_out) >= 2, replies
        assert timed_out[0].json()["error"]["type"] == "timeout"
        assert "retry-after" in timed_out[0].headers
        assert {r.status for r in replies} <= {200, 503}
        time.sleep(2.5)  # let the device finish the forward whose caller gave up
        assert s.decide(SUPPORT_TICKET).status == 200


def test_503_while_loading():
    with Server(env={"CLEFCORE_TEST_LOAD_DELAY_S": "2"}) as s:
        health = s.get("/health")
        assert health.status == 503 and health.json()["status"] == "loading"
        assert health.headers["retry-after"]
        reply = s.decide(SUPPORT_TICKET)
        assert reply.status == 503 and reply.json()["error"]["type"] == "unavailable_error"
        assert reply.headers["retry-after"]
        assert s.get("/v1/models").status == 503
        assert s.get("/live").status == 200
        assert "clef_ready 0.0" in s.get("/metrics").text
        s.wait_ready()
        assert s.decide(SUPPORT_TICKET).status == 200


def test_device_failure_fails_alone_and_the_server_keeps_serving(engine):
    good = [ticket(f"healthy request {i}") for i in range(5)]
    poisoned = ticket("please BOOM now")
    with Server("--max-batch-requests", "8", "--min-queue-wait", "1000",
                env={"CLEFCORE_TEST_FAIL_MARKER": "BOOM", "CLEFCORE_TEST_BATCH_DELAY_S": "0.2"}) as s:
        s.wait_ready()
        s.decide(SUPPORT_TICKET)
        replies = concurrently(s.decide, good[:3] + [poisoned] + good[3:])
        failed = replies[3]
        assert failed.status == 500 and failed.json()["error"]["type"] == "device_error", failed
        for body, reply in zip(good, replies[:3] + replies[4:]):
            assert reply.status == 200, reply
            assert same_answers(reply.json(), engine.decide(body))
        cf = s.post("/client/v4/accounts/a/ai/run/@cf/cloudflare/clef", dict(poisoned, model="clef"))
        assert cf.status == 500 and cf.json()["errors"][0]["code"] == 5012
        assert s.decide(SUPPORT_TICKET).status == 200
        assert s.get("/health").status == 200
        assert s.metric("clef_request_failures_total", 'type="device_error"') == 2
        # the self-check after each failure passed: a failed request, not a failed device
        assert s.metric("clef_device_faults_total") == 0 and not s.events("device_faulted")
        assert s.proc.poll() is None


def unavailable(reply, reason: str) -> bool:
    """A 503 that says the device is in trouble, with a Retry-After."""
    error = reply.json()["error"]
    return (reply.status == 503 and error["type"] == "unavailable_error" and reason in error["message"]
            and int(reply.headers["retry-after"]) >= 1)


def load_with_four_queued(s: Server, pool: ThreadPoolExecutor, name: str) -> list:
    """Five requests, one forward at a time: once four of them wait in the queue, the fifth is on the device."""
    replies = [pool.submit(s.decide, ticket(f"{name} {i}")) for i in range(5)]
    until(lambda: s.metric("clef_queue_depth") == 4, 10, "four queued requests")
    return replies


def answered_but_one(replies: list, timeout: float) -> tuple[list, object]:
    """Wait until all of ``replies`` but one are answered; those answers and the one still waiting."""
    pending = set(replies)
    deadline = time.monotonic() + timeout
    while len(pending) > 1 and time.monotonic() < deadline:
        _, pending = wait(pending, timeout=deadline - time.monotonic(), return_when=FIRST_COMPLETED)
    assert len(pending) == 1, f"{len(pending)} requests still unanswered"
    return [r.result() for r in replies if r not in pending], pending.pop()


@contextlib.contextmanager
def continued(pid: int):
    """kill -CONT ``pid`` on the way out, should a failed assertion leave it stopped (it would outlive the test)."""
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def test_a_stalled_device_leaves_readiness_refuses_its_queue_and_recovers_or_is_given_up():
    """kill -STOP on the device process under load (a wedged GPU: it neither answers nor dies). Within the stall
    limit /health is 503 and the queued requests are answered 503 at once. kill -CONT within the grace: the
    request it ran is answered and the server is ready again. Stopped past the grace: the request it ran gets
    500 and the server exits 1, to be restarted."""
    # a forward takes the hook's 0.2 s and a fraction of that for the tiny model: 4x that is under the floor
    with Server("--stall-timeout", "2", "--device-grace", "4", "--max-batch-requests", "1",
                "--min-queue-wait", "1000", env={"CLEFCORE_TEST_BATCH_DELAY_S": "0.2"}).wait_ready() as s:
        device = s.device_pid()
        assert s.decide(SUPPORT_TICKET).status == 200          # a forward measures the rate
        with ThreadPoolExecutor(6) as pool, continued(device):
            # a stall that ends within the grace
            replies = load_with_four_queued(s, pool, "first")
            os.kill(device, signal.SIGSTOP)
            stopped = time.monotonic()
            health = until(lambda: (lambda h: h.status == 503 and h)(s.get("/health")), 2 + 2, "/health 503")
            assert health.json()["status"] == "stalled" and health.headers["retry-after"] == "5"
            queued, running = answered_but_one(replies, 3)
            assert time.monotonic() - stopped < 2 + 2
            assert all(unavailable(r, "stalled") for r in queued), queued
            started = time.monotonic()
            late = s.decide(ticket("sent during the stall"))
            assert unavailable(late, "stalled") and time.monotonic() - started < 1, late
            assert s.get("/live").status == 200                  # within the grace the server is alive
            assert s.metric("clef_device_stalled") == 1 and s.metric("clef_ready") == 0
            assert s.metric("clef_device_faults_total", 'kind="stall"') == 1 and len(s.events("device_stalled")) == 1
            os.kill(device, signal.SIGCONT)
            assert running.result(10).status == 200
            until(lambda: s.get("/health").status == 200, 5, "/health 200 again")
            assert s.decide(SUPPORT_TICKET).status == 200
            assert s.metric("clef_device_stalled") == 0 and s.metric("clef_ready") == 1
            assert s.wait_for_events("device_recovered", len)[0]["was"] == "stalled"

            # a stall past the grace
            replies = load_with_four_queued(s, pool, "second")
            os.kill(device, signal.SIGSTOP)
            queued, running = answered_but_one(replies, 2 + 2)
            assert all(unavailable(r, "stalled") for r in queued), queued
            assert s.wait_exit(4 + 10) == 1
            failed = running.result(1)
            assert failed.status == 500 and failed.json()["error"]["type"] == "device_error", failed
            assert "given up after 4 s stalled" in failed.json()["error"]["message"]
        assert len(s.events("device_stalled")) == 2 and len(s.events("device_given_up")) == 1
        gave_up = s.events("device_given_up")[0]
        assert gave_up["after_s"] == 4 and s.events("exit")[0]["code"] == 1


def test_a_device_that_fails_every_call_leaves_readiness_within_seconds():
    """After a sticky fault (the test hook: as after an illegal memory access, every call of the device process
    fails) the request that struck it gets 500, the self-check that follows fails, and within seconds /health is
    503 and the requests waiting are answered 503, not each failed in turn; the device stays faulted through its
    checks and is given up after the grace."""
    with Server("--device-grace", "5", "--max-batch-requests", "1", "--min-queue-wait", "1000",
                env={"CLEFCORE_TEST_STICKY_MARKER": "XID", "CLEFCORE_TEST_BATCH_DELAY_S": "0.3"}) as s:
        s.wait_ready()
        assert s.decide(SUPPORT_TICKET).status == 200
        with ThreadPoolExecutor(5) as pool:
            struck = pool.submit(s.decide, ticket("the card logged XID 13"))
            until(lambda: s.metric("clef_requests_running") == 1, 5, "the poisoned request on the device")
            sent = time.monotonic()
            waiting = [pool.submit(s.decide, ticket(f"waiting {i}")) for i in range(4)]
            assert struck.result(10).status == 500
            replies = [r.result(10) for r in waiting]
            assert time.monotonic() - sent < 3, "the waiting requests were not refused at once"
        assert all(unavailable(r, "faulted") for r in replies), replies
        health = s.get("/health")
        assert health.status == 503 and health.json()["status"] == "faulted", health
        assert "failed its self-check" in health.json()["reason"]
        assert s.get("/live").status == 200
        assert s.metric("clef_device_faults_total", 'kind="self_check"') == 1 and s.metric("clef_ready") == 0
        assert s.wait_exit(5 + 10) == 1
        assert len(s.events("device_faulted")) == 1 and len(s.events("device_given_up")) == 1
        assert not s.events("device_recovered")


def test_client_disconnect_drops_the_queued_request():
    with Server("--max-batch-requests", "1", env={"CLEFCORE_TEST_BATCH_DELAY_S": "2.0"}).wait_ready() as s:
        first = threading.Thread(target=s.decide, args=(ticket("occupies the device"),))
        first.start()
        time.sleep(0.2)
        payload = json.dumps(ticket("I will hang up")).encode()
        raw = socket.create_connection(("127.0.0.1", s.port))
        raw.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        time.sleep(0.3)
        raw.close()
        first.join()
        until(lambda: s.metric("clef_requests_cancelled_total") >= 1, 5, "the cancellation")
        assert s.metric("clef_requests_cancelled_total") == 1
        assert any(e["status"] == 499 for e in s.wait_for_events(
            "request", lambda events: any(e["status"] == 499 for e in events)))
        time.sleep(2.2)
        # The dropped request never reached the device: one batch for `first`, none for it.
        assert s.metric("clef_batches_total") == 1
        assert s.decide(SUPPORT_TICKET).status == 200


def test_sigterm_drains_accepted_requests_then_exits():
    with Server("--max-batch-requests", "1", "--shutdown-timeout", "20",
                env={"CLEFCORE_TEST_BATCH_DELAY_S": "0.5"}).wait_ready() as s:
        with ThreadPoolExecutor(4) as pool:
            accepted = [pool.submit(s.decide, ticket(f"in flight {i}")) for i in range(4)]
            time.sleep(0.3)
            started = time.monotonic()
            s.proc.send_signal(15)
            time.sleep(0.2)
            health = s.get("/health")
            assert health.status == 503 and health.json()["status"] == "draining"
            late = s.decide(SUPPORT_TICKET)
            assert late.status == 503 and late.json()["error"]["type"] == "unavailable_error"
            assert [f.result().status for f in accepted] == [200] * 4
        assert s.wait_exit(30) == 0
        assert time.monotonic() - started < 20
        assert s.events("drained") and s.events("exit")[0]["code"] == 0


def test_drain_timeout_bounds_the_exit():
    with Server("--max-batch-requests", "1", "--shutdown-timeout", "1", "--min-queue-wait", "1000",
                env={"CLEFCORE_TEST_BATCH_DELAY_S": "0.8"}).wait_ready() as s:
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(s.decide, ticket(f"slow {i}")) for i in range(6)]
            time.sleep(0.3)
            started = time.monotonic()
            s.proc.send_signal(15)
            code = s.wait_exit(30)
            elapsed = time.monotonic() - started
            statuses = []
            for f in futures:
                try:
                    statuses.append(f.result().status)
                except OSError:
                    statuses.append("dropped")
        assert code == 0
        assert elapsed < 1 + 1.5, elapsed  # the timeout plus the forward that was already running
        assert "dropped" not in statuses, statuses  # requests left over are answered 503, not cut off
        assert set(statuses) <= {200, 503} and 503 in statuses, statuses
        assert s.events("drain_timeout")


def test_failed_load_exits_nonzero(tmp_path):
    with Server("--model", str(tmp_path)) as s:
        assert s.wait_exit(60) == 1
        assert s.events("load_failed")
