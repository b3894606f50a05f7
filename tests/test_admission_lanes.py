"""Admission and dispatch over several lanes (server/batcher.py, server/admission.py's "N lanes"): the work
ahead of a request drains at N times one device's rate, against hand-worked numbers; with one lane every number
is tests/test_admission.py's. And a chunked run's steps all go to the device process that started it."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from clefcore.server.admission import Budgets, CostPolicy, LaneView
from clefcore.server.device_process import Step
from server_harness import BUDGETS, FAKE_STATUS, IDLE, NOW, Prepared, batcher, entry, view, whole

POLICY = CostPolicy(BUDGETS)   # server_harness's numbers, on more devices


def test_two_busy_lanes_a_short_request_waits_for_half_their_steps_left_then_its_own_run():
    first = LaneView(4_000, NOW - 1.0, None, math.inf)    # 3,000 left
    second = LaneView(2_000, NOW - 0.5, None, math.inf)   # 1,500 left
    two = view(lanes=(first, second), chunk=0)
    # 4,500 tokens ahead over two devices (2.25 s), then its own 100 on one (0.1 s)
    assert POLICY.expected_wait(100, two) == pytest.approx(2.35)
    # the order alone: one step on each lane (4,000 and 2,000) and its own run on each, over both: 6,200 / 2,000
    assert POLICY.budget(100, two) == pytest.approx(3.1)
    assert POLICY.refusal(100, two) is None


def test_queued_work_drains_over_both_lanes_so_what_one_refuses_two_admit():
    ten = whole(*[(300, NOW)] * 10)                                    # 3,000 tokens of whole prompts
    one, two = view(ten), view(ten, lanes=(IDLE, IDLE))
    for each in (one, two):
        # idle lanes: the floor is a step, a chunk and its own run however many lanes there are
        assert POLICY.budget(400, each) == pytest.approx(2.4)
    assert POLICY.expected_wait(400, one) == pytest.approx(3.4)     # 3 s ahead + its own 0.4 s
    assert POLICY.expected_wait(400, two) == pytest.approx(1.9)     # 1.5 s ahead + its own 0.4 s
    assert POLICY.refusal(400, one).reason == "queued_work"
    assert POLICY.refusal(400, two) is None
    # 4,500 tokens: 2.65 s > 2.4 s
    refusal = POLICY.refusal(400, view(whole(*[(300, NOW)] * 15), lanes=(IDLE, IDLE)))
    assert refusal.wait_s == pytest.approx(2.65) and refusal.retry_after_s == 1


def test_each_lanes_due_chunk_counts_and_a_chunk_not_yet_due_does_not():
    due = LaneView(0, 0.0, 5_000, NOW - 4)        # its next chunk's key came long ago
    stepped = LaneView(0, 0.0, 5_000, NOW + 1)    # just stepped: due in 1 s
    assert POLICY.expected_wait(100, view(lanes=(due, stepped))) == pytest.approx(0.6)   # one chunk over two
    assert POLICY.expected_wait(100, view(lanes=(due, due))) == pytest.approx(1.1)   # both lanes' chunks


def test_a_long_prompt_counts_the_chunked_runs_and_long_prompts_ahead_over_the_lanes():
    policy = CostPolicy(Budgets(1.0, 20.0, 10_000))
    running = LaneView(0, 0.0, 3_000, NOW + 1)
    waiting = entry(8_000, NOW - 1)
    # 3,000 left of the run and the 8,000 ahead, over two devices (5.5 s), then its own 9,000 on one (9 s)
    assert policy.expected_wait(9_000, view(long=(waiting,), lanes=(running, IDLE))) == pytest.approx(14.5)


def test_the_estimated_wait_is_the_backlog_over_every_lane():
    b, metrics = batcher([None, None], budgets=Budgets(1.0, 20.0, 10_000), age_rate=None)

    async def queue_one():
        waiting = asyncio.ensure_future(b.submit(Prepared(num_tokens=8_000), time.monotonic() + 60))
        await asyncio.sleep(0)
        assert metrics.registry.get_sample_value("clef_estimated_wait_seconds") == pytest.approx(8_000 / 2_000)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)

    asyncio.run(queue_one())


class FakeDevice:
    """A device process without a process: a chunked run's state lives here, as in the real one, so a chunk
    step sent to the wrong device finds no run (or another prompt's) and says so."""

    def __init__(self, name: str):
        self.name = name
        self.status = FAKE_STATUS
        self.run = None          # [prompt, tokens left]
        self.ran: list = []      # (op, prompt) in order

    async def infer(self, prepared):
        self.ran.append(("infer", [p.name for p in prepared]))
        await asyncio.sleep(0.01)
        return [({"by": self.name, "prompt": p.name}, None) for p in prepared], 0.01

    async def step(self, prepared, tokens, images=0):
        if prepared is not None:
            self.run = [prepared, prepared.num_tokens]
        assert self.run is not None, f"{self.name}: a chunk step with no run started here"
        self.ran.append(("step", self.run[0].name))
        await asyncio.sleep(0.01)
        tokens = min(tokens, self.run[1])
        self.run[1] -= tokens
        done = self.run[1] == 0
        response = {"by": self.name, "prompt": self.run[0].name} if done else None
        if done:
            self.run = None
        return Step(done, response, tokens, 0 if done else self.run[1], None, 0.01)

    async def drop(self):
        self.run = None


def test_a_chunked_run_stays_on_the_lane_that_started_it():
    """Two long prompts, one started on each lane, then a stream of short ones: each long prompt's chunks all
    run on the device whose process holds its state, with whole prompts between them, whichever lane is free
    when its next chunk is due."""
    devices = [FakeDevice("a"), FakeDevice("b")]

    async def main():
        b, _ = batcher(devices, max_batch_requests=2, budgets=Budgets(100.0, 100.0, 10_000),
                       start_rate=100_000.0, age_rate=None)
        b.start()
        deadline = time.monotonic() + 30
        longs = [asyncio.ensure_future(b.submit(Prepared(num_tokens=4_000, name=f"long{i}"), deadline))
                 for i in range(2)]
        await asyncio.sleep(0.005)       # both lanes take one (a free lane starts a long prompt)
        shorts = []
        for i in range(12):
            shorts.append(asyncio.ensure_future(b.submit(Prepared(num_tokens=100, name=f"short{i}"), deadline)))
            await asyncio.sleep(0.005)
        answers = await asyncio.gather(*longs, *shorts)
        await b.stop()
        return answers

    answers = asyncio.run(main())
    assert [a.response["prompt"] for a in answers] == ["long0", "long1"] + [f"short{i}" for i in range(12)]
    for answer, name in zip(answers[:2], ("long0", "long1")):
        by = answer.response["by"]
        steps = [prompt for device in devices for op, prompt in device.ran if op == "step" and prompt == name]
        mine = [prompt for op, prompt in next(d for d in devices if d.name == by).ran if op == "step"]
        assert len(steps) == 4 and mine.count(name) == 4, (name, devices[0].ran, devices[1].ran)
    assert {answer.response["by"] for answer in answers[:2]} == {"a", "b"}   # one run on each lane
    assert all(any(op == "infer" for op, _ in device.ran) for device in devices)   # whole prompts between chunks
