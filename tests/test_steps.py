"""Device steps bounded in time (server/steps.py, server/batcher.py): --max-batch-tokens and --chunk-tokens at auto
are the tokens of a --step-budget step at the measured rate, between a floor and the cap the memory is reserved
for, and follow the rate as it moves; explicit numbers stay. And the one order over all the work, shortest first
with aging, on a fake clock: a short request passes a long prompt only within the aging rule, and a long prompt
is not starved by a stream of short ones."""

from __future__ import annotations

import asyncio
import contextvars
import time
from types import SimpleNamespace

import pytest

from clefcore import cli
from clefcore.options import STEP_BUDGET_S, STEP_CAP_TOKENS, STEP_FLOOR_TOKENS, ServiceConfig
from clefcore.server.admission import Budgets, measured_rate
from clefcore.server.batcher import Batcher
from clefcore.server.device_process import Step
from clefcore.server.steps import StepSize
from server_harness import FAKE_STATUS, Prepared, Server, batcher


def test_auto_is_the_rate_times_the_budget_between_the_floor_and_the_cap():
    auto = StepSize(None, 0.2)
    assert auto.at(10_000) == 2_000                      # 0.2 s at 10,000 tokens/s
    assert auto.at(12_345) == 2_469                      # whole tokens, rounded down: the step fits the budget
    assert auto.at(1_000) == STEP_FLOOR_TOKENS           # a slow device: the floor
    assert auto.at(1e9) == STEP_CAP_TOKENS               # a fast one: the cap the memory is reserved for
    assert StepSize(None, 0.5).at(10_000) == 5_000       # a larger budget, larger steps
    for fixed in (0, 97, 16_384):                        # an explicit number wins, past the floor and cap too
        assert StepSize(fixed, 0.2).at(10_000) == fixed == StepSize(fixed, 0.2).at(10)
    with pytest.raises(ValueError, match="step budget must be > 0"):
        StepSize(None, 0.0)
    # the default budget keeps H100 steps (~28k prompt tokens a second of device time) within 2x the old 4096
    assert 2_048 <= StepSize(None, STEP_BUDGET_S).at(28_000) <= 8_192


def test_the_rate_measured_at_start_is_over_every_devices_run():
    assert measured_rate([(1_000, 0.5)]) == 2_000
    assert measured_rate([(1_000, 0.5), (3_000, 0.5)]) == 4_000      # two devices: their tokens over their time
    with pytest.raises(ValueError, match="a rate needs tokens and time"):
        measured_rate([(1_000, 0.0)])


def test_a_server_sizes_its_steps_from_the_rate_it_measured_at_start():
    """The device slowed to ~1 ms a token (a test hook), steps of 2 s: the rate measured at start sizes them
    (~1,700 tokens, above the floor), so a ~2,300-token prompt runs chunked, and the gauge follows the rate."""
    with Server("--step-budget", "2", env={"CLEFCORE_TEST_TOKEN_DELAY_S": "0.001"}).wait_ready() as s:
        (ready,) = s.events("ready")
        rate, batch, chunk = ready["rate_tokens_per_s"], ready["max_batch_tokens"], ready["chunk_tokens"]
        assert 200 < rate < 1_000 and batch == chunk and abs(chunk - 2 * rate) <= 2, ready
        state = " ".join(f"node {i} reports checkout error;" for i in range(300))
        reply = s.decide({"model": "clef", "state": state,
                          "questions": {"urgent": {"type": "noul", "instructions": "Is it urgent?"}}})
        assert reply.status == 200 and reply.json()["usage"]["input_tokens"] > chunk
        assert s.metric("clef_chunk_steps_total") >= 2
        rate = s.metric("clef_device_rate_tokens_per_second")
        assert s.metric("clef_step_tokens", 'limit="chunk_tokens"') == max(STEP_FLOOR_TOKENS, int(2 * rate))


def auto_batcher(**kw) -> Batcher:
    """Steps of 0.5 s at auto, not started."""
    options = dict(max_batch_tokens=None, max_batch_requests=64, budgets=Budgets(100.0, 100.0, 10_000),
                   chunk_tokens=None, step_budget=0.5, start_rate=2_000.0, age_rate=None)
    return batcher(**dict(options, **kw))[0]


def step_gauge(b: Batcher, limit: str) -> float:
    return b._metrics.registry.get_sample_value("clef_step_tokens", {"limit": limit})


def stepped(b: Batcher, tokens: int, seconds: float) -> None:
    """A step of ``tokens`` took ``seconds`` of device time, as the batcher tells its admission."""
    now = time.monotonic()
    b.admission.on_step(tokens, seconds, started=now - seconds, waiting_since=None, now=now)


def test_auto_sizes_follow_the_measured_rate():
    b = auto_batcher(start_rate=6_000.0)                           # the rate measured at start
    assert (b.batch_tokens, b.chunk_tokens) == (3_000, 3_000)      # 0.5 s of it
    assert step_gauge(b, "max_batch_tokens") == step_gauge(b, "chunk_tokens") == 3_000
    assert not b.admission.snapshot().chunked(2_500)
    stepped(b, 4_000, 1.0)                                         # the first step served moves it: 4,000
    assert (b.batch_tokens, b.chunk_tokens) == (2_877, 2_877)      # tokens weigh 12 %, 6,000 -> 5,756 tokens/s
    for _ in range(100):                                           # then the device slows down
        stepped(b, 8_000, 8.0)
    assert b.rate == pytest.approx(1_000, rel=1e-3)
    assert b.batch_tokens == b.chunk_tokens == STEP_FLOOR_TOKENS   # 500 would be under the floor
    assert step_gauge(b, "chunk_tokens") == STEP_FLOOR_TOKENS
    assert b.admission.snapshot().chunked(2_500)                   # what runs chunked follows the chunk
    # aging follows it too, at a third of it: a request is passed by shorter work for up to 3x its own run
    assert b.admission.snapshot().whole.age_rate == pytest.approx(b.rate / 3)
    fixed = auto_batcher(max_batch_tokens=4_096, chunk_tokens=0)
    stepped(fixed, 100, 1.0)
    assert (fixed.batch_tokens, fixed.chunk_tokens) == (4_096, 0)
    assert not fixed.admission.snapshot().chunked(24_000)
    assert step_gauge(fixed, "max_batch_tokens") == 4_096


def test_config_defaults_to_auto_and_reserves_the_cap():
    config = ServiceConfig(model="m")
    assert config.reserve_limits == {"batch_tokens": STEP_CAP_TOKENS, "batch_requests": 32,
                                     "chunk_tokens": STEP_CAP_TOKENS}
    explicit = ServiceConfig(model="m", max_batch_tokens=2_048, chunk_tokens=0)
    assert explicit.reserve_limits == {"batch_tokens": 2_048, "batch_requests": 32, "chunk_tokens": 0}
    parser = cli.build_parser()
    flags = ServiceConfig.from_args(parser.parse_args(["serve", "--model", "m", "--max-batch-tokens", "1024",
                                                       "--chunk-tokens", "AUTO", "--step-budget", "0.05"]))
    assert (flags.max_batch_tokens, flags.chunk_tokens, flags.step_budget) == (1_024, None, 0.05)
    for field, value, limit in (("step_budget", 0.0, "> 0"), ("max_batch_tokens", 0, "> 0 or None"),
                                ("chunk_tokens", -1, ">= 0 or None")):
        with pytest.raises(ValueError, match=f"{field} must be {limit}"):
            ServiceConfig(model="m", **{field: value})


@pytest.mark.parametrize("flag, value, message", [
    ("--max-batch-tokens", "0", "must be > 0"),
    ("--max-batch-tokens", "many", "invalid int or auto value"),
    ("--chunk-tokens", "-5", "must be >= 0"),
    ("--step-budget", "0", "must be > 0"),
    ("--max-queue-wait", "0", "must be > 0"),
    ("--age-rate", "fast", "tokens/s, inf or auto"),
    ("--min-queue-wait", "-1", "must be > 0"),
])
def test_bad_step_and_overload_flags_are_refused_by_name(flag, value, message, capsys):
    """As `clefcore serve` (cli.main) parses them: exit 2, naming the flag and its limit."""
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args(["serve", "--model", "m", flag, value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and message in err


class FakeDevice:
    """A device on a fake clock: each forward or chunk step moves the clock on by its tokens at 1,000 tokens/s,
    letting ``arrive(until)`` submit what arrives on the way, each at its own time. Records what ran, when it
    started and when each prompt's answer came."""

    def __init__(self, clock, arrive):
        self.clock, self.arrive = clock, arrive
        self.status = FAKE_STATUS
        self.ran: list = []      # (op, prompt name, started at)
        self.answered: dict[str, float] = {}
        self.run = None          # [prompt, tokens left]

    async def infer(self, prepared):
        self.ran += [("infer", p.name, self.clock.t) for p in prepared]
        await self.arrive(self.clock.t + sum(p.num_tokens for p in prepared) / 1_000)
        self.answered.update((p.name, self.clock.t) for p in prepared)
        return [({"prompt": p.name}, None) for p in prepared], sum(p.num_tokens for p in prepared) / 1_000

    async def step(self, prepared, tokens, images=0):
        if prepared is not None:
            self.run = [prepared, prepared.num_tokens]
        self.ran.append(("step", self.run[0].name, self.clock.t))
        tokens = min(tokens, self.run[1])
        await self.arrive(self.clock.t + tokens / 1_000)
        self.run[1] -= tokens
        done = self.run[1] == 0
        if done:
            self.answered[self.run[0].name] = self.clock.t
        return Step(done, {"prompt": self.run[0].name} if done else None, tokens, self.run[1], None,
                    tokens / 1_000)

    async def drop(self):
        self.run = None


def run_on_fake_clock(monkeypatch, plan, max_batch_requests=64):
    """A one-lane batcher at 1,000 tokens/s (batches and chunks of 1,000 tokens, aging at that rate, budgets
    out of the way) on a fake clock. ``plan``: (arrival time, name, prompt tokens). Returns the device."""
    clock = SimpleNamespace(t=0.0)
    arrival = contextvars.ContextVar("arrival")      # a submitting task's own clock: the time it arrived
    monkeypatch.setattr("clefcore.server.batcher.time", SimpleNamespace(monotonic=lambda: arrival.get(clock.t)))
    pending = sorted(plan)
    tasks = []

    def submit_due(until):
        while pending and pending[0][0] <= until:
            at, name, tokens = pending.pop(0)
            token = arrival.set(at)                  # the task takes the context as it is now
            tasks.append(asyncio.ensure_future(b.submit(Prepared(num_tokens=tokens, name=name), at + 1e3)))
            arrival.reset(token)

    async def arrive(until):
        """While the device runs until ``until``: what arrives meanwhile is queued, each at its own time."""
        submit_due(until)
        clock.t = until
        await asyncio.sleep(0)                       # the new tasks queue their requests before the step ends

    device = FakeDevice(clock, arrive)
    b, _ = batcher([device], max_queue=10_000, max_batch_requests=max_batch_requests,
                   budgets=Budgets(1e3, 1e3, 10_000))

    async def main():
        b.start()
        while pending or not all(t.done() for t in tasks):
            await asyncio.sleep(0)
            if pending and not b.queued and not b._lanes[0].running and b._lanes[0].active is None:
                clock.t = pending[0][0]              # idle: on to the next arrival
                submit_due(clock.t)
        await b.stop()
        assert all(t.result().response["prompt"] == name for t, (_, name, _) in zip(tasks, sorted(plan)))

    asyncio.run(main())
    return device


def test_a_short_request_passes_a_long_prompt_only_within_the_aging_rule(monkeypatch):
    """Aging at 1,000 tokens/s: the 3,000-token prompt arriving at 0 has the key 3.0; a 125-token request's key
    is its arrival + 0.125. While 1,000-token batches keep the device busy until 4, one arriving at 2.5 (key
    2.625) comes to pass it, one arriving at 2.9375 (key 3.0625) does not: it arrived more than (3,000 - 125) /
    1,000 s after the long one. One request a batch, so that the order shows. (Times are binary fractions: the
    fake clock adds them exactly.)"""
    plan = [(0.0, "long", 3_000), (0.0, "busy", 1_000), (0.5, "busy2", 1_000), (1.0, "busy3", 1_000),
            (1.5, "busy4", 1_000), (2.5, "early", 125), (2.9375, "late", 125)]
    device = run_on_fake_clock(monkeypatch, plan, max_batch_requests=1)
    assert [(op, name, at) for op, name, at in device.ran] == [
        ("infer", "busy", 0.0), ("infer", "busy2", 1.0), ("infer", "busy3", 2.0), ("infer", "busy4", 3.0),
        ("infer", "early", 4.0), ("step", "long", 4.125), ("infer", "late", 5.125),   # its next chunk's key: 6.125
        ("step", "long", 5.25), ("step", "long", 6.25)]
    assert device.answered["long"] == 7.25


def test_a_long_prompt_is_not_starved_by_a_stream_of_short_ones(monkeypatch):
    """125-token requests every 0.125 s keep the device (1,000 tokens/s) busy by themselves: every step ends
    with one just arrived. The 3,000-token prompt arriving at 0.0625 (key 3.0625) starts once the waiting short
    one's key (its arrival + 0.125) is past its own, at 3.0; each of its next chunks once the short ones that
    arrived before that chunk's key (its ready time + 1.0) have run. Had it to wait until no short one waits,
    it would start only when the stream ends at 25 s."""
    plan = [(0.0625, "long", 3_000)] + [(0.125 * i, f"s{i}", 125) for i in range(200)]
    device = run_on_fake_clock(monkeypatch, plan)
    steps = [at for op, name, at in device.ran if op == "step"]
    assert len(steps) == 3 and steps[0] == 3.0, steps
    assert device.answered["long"] < 12.0, (steps, device.answered["long"])
    # short ones ran before and between its chunks: the stream was served beside it
    assert sum(1 for op, name, at in device.ran if op == "infer" and at < device.answered["long"]) >= 60
