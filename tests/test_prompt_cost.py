"""The longest prompt a deployment takes (server/prompt_cost.py): a chunk's time growing with its offset, fitted
from one chunked run, the limit it sets within the wait budget, and a chunked run stopped by the batcher once its
own pace shows it would pass that budget."""

from __future__ import annotations

import asyncio
import time

import pytest

from clefcore.errors import PromptTokensError
from clefcore.server.admission import Budgets
from clefcore.server.batcher import Batcher
from clefcore.server.device_process import Step
from clefcore.server.metrics import Metrics
from clefcore.server.prompt_cost import PromptCost, PromptLimit
from server_harness import FAKE_STATUS, Prepared, unwatched


def chunks(per_token: float, pair: float, chunk: int, count: int, noise=()):
    """(offset, tokens, seconds) of ``count`` chunks whose time is ``per_token`` a token plus ``pair`` for each of
    their tokens times each token before them (and within them, causally), each times 1 + its noise."""
    out = []
    for i in range(count):
        offset = i * chunk
        seconds = per_token * chunk + pair * chunk * (offset + chunk / 2)
        out.append((offset, chunk, seconds * (1 + (noise[i] if i < len(noise) else 0.0))))
    return out


def test_the_fit_finds_a_chunks_cost_a_token_and_its_growth_with_the_offset():
    samples = chunks(4e-4, 5e-8, 1_391, 4)[1:]
    cost = PromptCost.fit(samples)
    assert cost.per_token_pair == pytest.approx(5e-8) and cost.per_token == pytest.approx(4e-4)
    # the whole run of such chunks is what the model says, whatever the chunk size
    assert sum(s for _, _, s in chunks(4e-4, 5e-8, 512, 11)) == pytest.approx(cost.seconds(11 * 512), rel=1e-9)
    assert sum(s for _, _, s in chunks(4e-4, 5e-8, 1_391, 4)) == pytest.approx(cost.seconds(4 * 1_391), rel=1e-9)


def test_noise_that_turns_the_growth_negative_counts_none():
    samples = chunks(1e-4, 0.0, 1_024, 4, noise=(0.0, 0.3, 0.1, 0.0))[1:]
    cost = PromptCost.fit(samples)
    assert cost.per_token_pair == 0.0
    assert cost.per_token == pytest.approx(sum(s / t for _, t, s in samples) / 3)     # the chunks' mean
    # a steep rise through noise would put the line under zero at the start: the fastest chunk's cost counts
    steep = [(1_024, 1_024, 0.01), (2_048, 1_024, 0.5), (3_072, 1_024, 1.0)]
    assert PromptCost.fit(steep).per_token == pytest.approx(0.01 / 1_024)
    with pytest.raises(ValueError):
        PromptCost.fit(samples[:1])
    with pytest.raises(ValueError):
        PromptCost.fit([(0, 10, 0.1), (0, 10, 0.2)])


@pytest.mark.parametrize("pair", [0.0, 1e-9, 5e-8, 1e-6])
def test_longest_is_the_last_length_within_the_seconds(pair):
    cost = PromptCost(1 / 9_000.0, pair)
    for seconds in (0.01, 1.0, 15.0):
        tokens = cost.longest(seconds)
        assert cost.seconds(tokens) <= seconds < cost.seconds(tokens + 1)


def test_the_limit_is_the_context_where_the_device_runs_it_within_the_budget():
    fast = PromptCost(1 / 30_000.0, 1e-11)              # a GPU: 24,576 tokens in under a second
    assert PromptLimit.sized(None, fast, 15.0, 24_576).tokens == 24_576
    slow = PromptCost(1 / 9_000.0, 5e-8)                # a CPU: 24,576 tokens in 17.8 s
    assert slow.seconds(24_576) > 15.0
    limit = PromptLimit.sized(None, slow, 15.0, 24_576)
    assert limit.tokens == slow.longest(15.0) < 24_576
    assert PromptLimit.sized(30_000, slow, 15.0, 24_576).tokens == 24_576      # configured, within the context
    assert PromptLimit.sized(1_000, slow, 15.0, 24_576).tokens == 1_000


def test_a_prompt_over_the_limit_is_refused_naming_it():
    limit = PromptLimit.sized(None, PromptCost(1 / 9_000.0, 5e-8), 15.0, 24_576)
    limit.check(limit.tokens)
    with pytest.raises(PromptTokensError) as refused:
        limit.check(limit.tokens + 1)
    error = refused.value
    assert error.field == "state" and error.limit == f"{limit.tokens} tokens"
    assert f"prompt is {limit.tokens + 1} tokens" in error.message and "--max-prompt-tokens" in error.message


def test_a_run_slower_than_counted_is_refused_once_its_pace_shows_it():
    cost = PromptCost(1e-3, 0.0)                        # 1 ms a token: 15,000 tokens in the 15 s budget
    limit = PromptLimit.sized(None, cost, 15.0, 24_576)
    assert limit.tokens == 15_000 and limit.budget_s == 15.0
    assert limit.overrun(12_000, 3_000, 3.0) is None    # at the counted pace: 12 s
    assert limit.overrun(12_000, 3_000, 2.0) is None    # faster than counted counts as counted
    over = limit.overrun(12_000, 3_000, 4.5)            # 1.5x: 18 s
    assert isinstance(over, PromptTokensError) and over.field == "state" and over.limit == "15 s of device time"
    assert "about 18 s" in over.message and "first 3000" in over.message
    assert limit.overrun(12_000, 0, 0.0) is None and limit.overrun(12_000, 12_000, 30.0) is None
    # chunks that slow down as the prompt grows (1.0 s, 1.1 s, 1.2 s ... a 1,000-token chunk: 18.6 s in all) are
    # 1.15x the counted pace after four, 14.1 s at that pace; the line through its own chunks says 18.6 s
    steepening = [(i * 1_000, 1_000, 1.0 + 0.1 * i) for i in range(4)]
    assert limit.overrun(12_000, 4_000, 4.6) is None
    assert limit.overrun(12_000, 4_000, 4.6, steepening[:3]) is None          # three are too few to judge by
    over = limit.overrun(12_000, 4_000, 4.6, steepening)
    assert isinstance(over, PromptTokensError) and "about 18.6 s" in over.message
    assert limit.overrun(12_000, 4_000, 4.0, [(i * 1_000, 1_000, 1.0) for i in range(4)]) is None
    # growth that bends (0.01 s more a chunk, then 0.15 s), 10 of 16 chunks done, a 23 s budget: the pace says
    # 19.0 s and the line through all its chunks 22.7 s, both under; the line through their recent half 24.9 s
    bend = [(i * 1_000, 1_000, 1.0 + 0.01 * i if i < 6 else 1.05 + 0.15 * (i - 5)) for i in range(10)]
    seconds, roomy = sum(t for _, _, t in bend), PromptLimit.sized(None, cost, 23.0, 24_576)
    assert roomy.overrun(16_000, 10_000, seconds) is None
    assert "about 24.9 s" in roomy.overrun(16_000, 10_000, seconds, bend).message
    # a configured limit is the operator's: no run's pace refuses a prompt within it
    assert PromptLimit.sized(20_000, cost, 15.0, 24_576).overrun(12_000, 3_000, 30.0) is None


class PacedDevice:
    """A device process running one chunked prompt whose chunks take ``slower`` times what ``cost`` counts (the
    seconds it reports; nothing sleeps); records its steps and drops."""

    def __init__(self, cost: PromptCost, slower: float):
        self.status = FAKE_STATUS
        self.lost = None
        self.cost, self.slower = cost, slower
        self.steps, self.drops, self.run = 0, 0, None

    async def step(self, prepared, tokens, images=0):
        if prepared is not None:
            self.run = [prepared, 0]
        run = self.run
        done_before = run[1]
        run[1] = min(run[0].num_tokens, done_before + tokens)
        self.steps += 1
        seconds = self.slower * (self.cost.seconds(run[1]) - self.cost.seconds(done_before))
        left = run[0].num_tokens - run[1]
        return Step(left == 0, {"prompt": "done"} if left == 0 else None, run[1] - done_before, left, None, seconds)

    async def drop(self):
        self.drops += 1

    async def self_check(self):
        pass


def run_paced(slower: float):
    """A 12,000-token prompt in chunks of 1,000 on a PacedDevice, at a limit of 15 s of 1 ms tokens: (its outcome,
    or what it was refused with; the device)."""
    cost = PromptCost(1e-3, 0.0)
    limit = PromptLimit.sized(None, cost, 15.0, 24_576)
    device = PacedDevice(cost, slower)

    async def main():
        metrics = Metrics()
        watch = unwatched(metrics, grace_s=30.0)
        batcher = Batcher([device], metrics, watch=watch, max_queue=8, max_batch_tokens=1_000,
                          max_batch_requests=4, budgets=Budgets(60.0, 60.0, 24_576), start_rate=1_000.0,
                          chunk_tokens=1_000, prompt_limit=limit)
        batcher.start()
        try:
            return await batcher.submit(Prepared(num_tokens=12_000), time.monotonic() + 60)
        except PromptTokensError as refused:
            return refused
        finally:
            await batcher.stop()
            watch.close()

    return asyncio.run(main()), device


def test_the_batcher_stops_a_chunked_run_whose_pace_passes_the_budget():
    refused, device = run_paced(1.5)                    # 18 s at its pace: refused after its second chunk
    assert isinstance(refused, PromptTokensError) and "first 2000" in refused.message
    assert device.steps == 2 and device.drops == 1      # its state on the device dropped at once
    outcome, device = run_paced(1.0)                    # 12 s as counted: answered
    assert outcome.response == {"prompt": "done"} and device.steps == 12 and device.drops == 0
