"""Admission (server/admission.py): the measured rate, the budgets, the work counted before a request,
evictions and Retry-After, against hand-worked numbers; the policy read through snapshots of plain values, the
Admission object through its own interface, and the batcher (server/batcher.py) through what it does with the
answers."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from clefcore.scheduler import Entry
from clefcore.server import errors
from clefcore.server.admission import (Admission, Admit, BodySizer, Budgets, CostPolicy, Eviction, LaneView,
                                       Queues, QueueView, RateMeter, Reason, RecentShare, Refusal, Refused,
                                       retry_after, size_class)
from clefcore.server.device_process import Step
from clefcore.server.metrics import Metrics
from server_harness import BUDGETS, CHUNK, FAKE_STATUS, IDLE, NOW, Prepared, batcher, entry, view, whole


def test_rate_meter_starts_at_the_starts_measurement_and_follows_the_device():
    meter = RateMeter(2_000)
    assert meter.rate == 2_000
    meter.observe(1_000, 0.1)  # a measurement at start, not a guess: the first sample moves it as any other
    assert meter.rate == pytest.approx(2_400)
    for _ in range(200):
        meter.observe(16_384, 0.5)  # the device slowed to 32,768 tokens/s
    assert meter.rate == pytest.approx(32_768, rel=1e-3)
    before = meter.rate
    meter.observe(0, 0.1)
    meter.observe(100, 0.0)  # nothing to learn from empty or instant forwards
    assert meter.rate == before
    with pytest.raises(ValueError, match="start rate"):
        RateMeter(0)


def test_small_forwards_move_the_rate_less_than_large_ones():
    small, large = RateMeter(1_000), RateMeter(1_000)
    small.observe(1_000, 1.0)
    large.observe(1_000, 1.0)
    small.observe(64, 0.0064)      # 10,000 tokens/s, from a tiny batch
    large.observe(16_384, 1.6384)  # 10,000 tokens/s, from a full one
    assert 1_000 < small.rate < large.rate < 10_000


def test_budget_is_an_absolute_wait_growing_with_size_from_a_floor():
    budgets = Budgets(min_s=1.0, max_s=15.0, context_tokens=24_576)
    assert budgets(100) == 1.0 and budgets(1_200) == 1.0     # 15 s x 1,200 / 24,576 = 0.73 s: the floor
    assert budgets(8_192) == pytest.approx(5.0)
    assert budgets(24_576) == 15.0
    with pytest.raises(ValueError, match="budgets must be > 0"):
        Budgets(0.0, 15.0, 24_576)


def test_recent_share_follows_what_held_and_decays_when_it_stops():
    share = RecentShare(tau_s=2.0)
    assert share.share(0.0) == 0.0
    t = 0.0
    for _ in range(40):                      # held through 8 s of steps
        t += 0.2
        share.step(t, 0.2)
    assert share.share(t) > 0.95
    for _ in range(40):                      # then not at all
        t += 0.2
        share.step(t, 0.0)
    assert share.share(t) < 0.05
    share.step(t + 1.0, 0.5)                 # half of the last second
    assert 0.0 < share.share(t + 1.0) < 0.5
    assert share.share(t + 11.0) < share.share(t + 1.0) * 0.01   # no step since: decays


def test_a_refusal_names_one_of_the_reasons_the_wire_knows():
    assert Refusal("queue_full", 1, 0.0, 0.0).reason is Reason.QUEUE_FULL     # given as the wire names it
    assert [reason.value for reason in Reason] == ["queued_work", "queue_full", "evicted"]
    with pytest.raises(ValueError, match="reason must be one of queued_work, queue_full, evicted, got 'busy'"):
        Refusal("busy", 1, 0.0, 0.0)


def test_retry_after_and_size_classes():
    assert retry_after(2.5, 1.0, 15.0) == 2
    assert retry_after(1.1, 1.0, 15.0) == 1          # at least 1 s
    assert retry_after(1e9, 1.0, 15.0) == 15         # at most the cap
    assert [size_class(n) for n in (None, 1, 1_024, 1_025, 9_000, 30_000)] == [
        "unknown", "1024", "1024", "2048", "16384", "+Inf"]


# --- the policy, on snapshots (server_harness's numbers) ----------------------------------------------

def promised(policy: CostPolicy, e: Entry) -> Entry:
    """``e`` as admitted when it arrived, to an empty queue: promised by the end of its budget then."""
    e.answer_by = e.enqueued_at + policy.budget(e.tokens, view())
    return e


def whole_prompts_kept_coming() -> float:
    """Whole prompts were waiting through the last 10 s of steps: the share of time they waited, nearly 1."""
    share = RecentShare()
    t = NOW - 10.0
    share.step(t, 0.0)
    while t < NOW:
        t += 0.1
        share.step(t, 0.1)
    return share.share(NOW)


@pytest.fixture
def policy() -> CostPolicy:
    return CostPolicy(BUDGETS)


def test_queued_long_prompts_do_not_count_against_a_short_one(policy):
    long = (entry(8_000, NOW),)                                            # 8 s of long work, not started
    assert policy.expected_wait(100, view(long=long)) == pytest.approx(0.1)
    assert policy.refusal(100, view(long=long)) is None
    three = whole(*[(300, NOW)] * 3)
    assert policy.expected_wait(100, view(three, long)) == pytest.approx(0.1)    # shortest first: ahead of them
    assert policy.expected_wait(400, view(three, long)) == pytest.approx(1.3)    # behind them: 900 + its own 400
    # a long one behind: every whole prompt, the long one before it (shorter), its own, over the device; for the
    # 0.9 s the three take to run whole prompts wait, so that part of it counts as their flow (the long one
    # ahead runs from its key, 8 s, at twice its tokens' time, then its own, 18 s)
    alone, flowing = (900 + 8_000 + 9_000) / 1_000, 8 + 16 + 18
    share = 0.9 / alone
    assert policy.expected_wait(9_000, view(three, long)) == pytest.approx((1 - share) * alone + share * flowing)


def test_a_short_request_counts_what_is_left_of_the_running_step_and_is_never_refused_for_it_alone(policy):
    running = view(lanes=(LaneView(4_000, NOW - 1.0, None, math.inf),), chunk=0)   # a 4 s step, 1 s done
    assert policy.expected_wait(100, running) == pytest.approx(3.1)        # 3,000 left + its own
    assert policy.budget(100, running) == pytest.approx(4.1)   # that step + its own, over the 1 s floor
    assert policy.refusal(100, running) is None


def test_the_started_runs_next_chunk_counts_once_it_is_due(policy):
    due = LaneView(0, 0.0, 5_000, NOW - 4)          # its next chunk's key came long ago
    assert policy.expected_wait(100, view(lanes=(due,))) == pytest.approx(1.1)   # one chunk, not the 5,000 left
    stepped = LaneView(0, 0.0, 5_000, NOW + 1)      # just stepped: due in 1 s
    assert policy.expected_wait(100, view(lanes=(stepped,))) == pytest.approx(0.1)


def test_over_budget_a_short_request_is_refused_with_retry_after(policy):
    refusal = policy.refusal(400, view(whole(*[(300, NOW)] * 15)))      # 4.5 s of short work
    assert refusal.reason is Reason.QUEUED_WORK and refusal.wait_s == pytest.approx(4.9)
    # what the order alone may make it wait: a step, the next chunk and its own, over the 1 s floor
    assert refusal.budget_s == pytest.approx(2.4)
    assert refusal.retry_after_s == 3


def test_a_long_prompt_counts_the_shorter_work_that_passes_it_while_whole_prompts_keep_coming(policy):
    one = whole((300, NOW))
    # the order alone: its aging (5 s), a step and a chunk, then its run, twice its tokens' time while whole
    # prompts keep coming (each 1,000-token chunk lets pass what arrives within its aging: 1 s of work)
    assert policy.slow(view(one)) == 2.0
    assert policy.budget(5_000, view(one)) == pytest.approx(5 + 2 + 10)
    # none came lately: the whole prompt whose key comes first (0.3 s), then its own 5 s; the 0.3 s that one
    # waits is the least share of its wait that whole prompts flow
    assert policy.expected_wait(5_000, view(one)) == pytest.approx((1 - 0.3 / 5.3) * 5.3 + 0.3 / 5.3 * 15)
    share = whole_prompts_kept_coming()
    assert share > 0.99
    # they keep coming: it starts when its key comes up (5 s), and runs in 10 s
    assert policy.expected_wait(5_000, view(one, share=share)) == pytest.approx((1 - share) * 5.3 + share * 15)
    assert policy.refusal(5_000, view(one, share=share)) is None
    # a 6,000-token prompt queued ahead of it (key now - 4) starts first and runs for 12 s meanwhile: 22 s
    ahead = view(one, (entry(6_000, NOW - 10),), share=share)
    refusal = policy.refusal(5_000, ahead)
    assert refusal.reason is Reason.QUEUED_WORK
    assert refusal.wait_s == pytest.approx((1 - share) * (0.3 + 6 + 5) + share * 22)
    assert refusal.retry_after_s == 5                           # 22 s against 17 s
    # a whole prompt is not held back by them: the first chunk of the long prompt whose key came, and its own
    assert policy.expected_wait(500, ahead) == pytest.approx(1.8)
    assert policy.refusal(500, ahead) is None


def test_a_burst_of_whole_prompts_counts_before_it_moves_the_recent_share(policy):
    """A long prompt that arrives with a burst of whole prompts queued, before a step has ended since the burst
    came (the recent share still 0), is judged as the burst will make it wait: for the burst's run, at least,
    whole prompts wait, so that share of its wait is the flowing case's."""
    burst = whole(*[(300, NOW)] * 10)                  # 3 s of whole work, just queued
    alone = 3 + 5                                      # the burst, then its own 5 s
    flowing = 5 + 5_000 * 4 / 1_000                    # from its key at 5 s, at 4x (3,000 queued per chunk)
    assert policy.slow(view(burst)) == 4.0
    assert policy.expected_wait(5_000, view(burst)) == pytest.approx(5 / 8 * alone + 3 / 8 * flowing)
    # a recent share above the burst's part rules; nothing queued whole: nothing flows
    assert policy.expected_wait(5_000, view(burst, share=0.5)) == pytest.approx(0.5 * alone + 0.5 * flowing)
    assert policy.expected_wait(5_000, view()) == pytest.approx(5.0)


def test_a_queued_long_prompt_slowed_by_the_order_is_kept_and_one_a_run_holds_back_is_evicted(policy):
    """Before each chunk runs the whole work queued when it became due (here more than a chunk's aging lets
    pass), which slows a queued long prompt down past the answer time it was promised at 17 s. The order gives a
    prompt of its size a larger budget now (a fresh one would be admitted beside it), so it is kept: refusing it
    would turn a request that finishes in time into a late 429. A chunked run that started before it moves it
    out of that budget too: evicted."""
    share = whole_prompts_kept_coming()
    waiting = promised(policy, entry(5_000, NOW))
    assert waiting.answer_by - NOW == pytest.approx(17.0)
    some = view(whole(*[(300, NOW)] * 5), (waiting,), share=share)      # 1.5 s of whole work before it
    assert policy.slow(some) == 2.5                    # 1,500 tokens queued per 1,000-token chunk
    assert policy.late(some) == []                     # 5 + 12.5 s: late by 0.5 s of 17
    more = view(whole(*[(300, NOW)] * 10), (waiting,), share=share)     # 3 s: 5 + 20 s, 8 s past 17 s
    assert policy.budget(5_000, more) == pytest.approx(5 + 2 + 20)     # what the order gives it now: 27 s
    assert policy.late(more) == []
    running = LaneView(0, 0.0, 4_000, NOW - 1.0)       # 4,000 tokens of a run, at 4x: 16 s before its start
    held = view(whole(*[(300, NOW)] * 10), (waiting,), (running,), share=share)
    [eviction] = policy.late(held)
    assert eviction.entry is waiting and eviction.refusal.reason is Reason.EVICTED
    assert eviction.refusal.wait_s == pytest.approx((1 - share) * 12 + share * 36)   # past 27 + 6.75 s


def test_a_long_prompt_whose_key_came_counts_one_chunk_against_a_short_one(policy):
    long = (entry(3_000, NOW - 2.95),)                  # key now + 0.05: it starts before the next one
    assert policy.expected_wait(100, view(long=long)) == pytest.approx(1.1)   # its first chunk, then its own 100
    assert policy.expected_wait(40, view(long=long)) == pytest.approx(0.04)   # key now + 0.04: this one first
    running = LaneView(0, 0.0, 500, NOW + 10.5)         # the lane runs another one: no new one starts there
    assert policy.expected_wait(100, view(long=long, lanes=(running,))) == pytest.approx(0.1)


def test_queued_long_prompts_past_their_budget_are_evicted_in_start_order():
    """Each counts only the long prompts kept before it: the first one's eviction lets the second one stay."""
    policy = CostPolicy(Budgets(1.0, 20.0, 10_000))
    first = promised(policy, entry(2_000, NOW))         # promised 2 + 2 + 4 = 8 s: evicted past 10 s
    second = promised(policy, entry(3_000, NOW))        # promised 3 + 2 + 6 = 11 s: past 13.75 s
    assert policy.late(view(long=(first, second))) == []   # answered at 2 s and 5 s
    # a chunked run with 9,000 tokens left starts before them
    running = LaneView(0, 0.0, 9_000, NOW - 1.0)
    [eviction] = policy.late(view(long=(first, second), lanes=(running,)))
    assert eviction.entry is first and eviction.refusal.reason is Reason.EVICTED   # 11 s: past 10 s
    assert eviction.refusal.wait_s == pytest.approx(11.0) and eviction.refusal.retry_after_s >= 1
    # the second: 12 s without the first (14 s with it), kept


# --- the Admission object -------------------------------------------------------------------------------------

class Source:
    """The batcher's side of admission in plain values (admission.QueueSource): what a test sets is what it
    reads."""

    def __init__(self):
        self.set()

    def set(self, queue: QueueView = whole(), long: tuple[tuple[Entry, float], ...] = (),
            lanes: tuple[LaneView, ...] = (IDLE,), full: bool = False) -> None:
        self.now = Queues(CHUNK, queue, long, lanes, full)

    def queues(self) -> Queues:
        return self.now


def admission(source: Source | None = None, start: float = 1_000.0) -> tuple[Admission, Metrics, list[float]]:
    """An Admission over ``source`` (None: empty queues) whose rate was measured at ``start`` tokens/s; the metrics
    its refusals are counted in, and the rates it reported."""
    metrics, rates = Metrics(), []
    a = Admission(CostPolicy(BUDGETS), start, source or Source(), rejected=metrics.rejected,
                  held_tokens=metrics.held_tokens, on_rate=rates.append)
    return a, metrics, rates


def refused(metrics: Metrics, reason: str) -> float:
    return sum(s.value for m in metrics.rejected.collect() for s in m.samples
               if s.name.endswith("_total") and s.labels["reason"] == reason)


def held(metrics: Metrics) -> float:
    return metrics.registry.get_sample_value("clef_held_tokens")


def test_admission_learns_the_rate_and_the_waiting_share_from_steps():
    a, _, rates = admission(start=2_000.0)
    assert a.rate == 2_000 and a.snapshot(0.0).rate == 2_000
    # the start's measurement is moved, not replaced, by a first step twice as fast: a small one weighs 5 %
    a.on_step(1_000, 0.25, started=0.0, waiting_since=None, now=0.0)
    assert a.rate == pytest.approx(2_100) and a.snapshot(0.0).rate == a.rate and rates == [a.rate]
    a.on_step(1_000, 0.0, started=0.0, waiting_since=None, now=0.0)     # nothing learnt: still reported
    assert rates == [a.rate, a.rate]
    # a full step weighs half; whole prompts waited from 9.5 through a step that ran from 9 to 10: half of the
    # last second
    a.on_step(16_384, 16.384, started=9.0, waiting_since=9.5, now=10.0)
    assert a.rate == pytest.approx(1_550) and rates[-1] == a.rate
    assert 0.0 < a.snapshot(10.0).whole_share < 0.5
    steady = a.snapshot(10.0).whole_share
    a.on_step(1_000, 1.0, started=10.0, waiting_since=5.0, now=11.0)   # waited through all of the next step
    assert a.snapshot(11.0).whole_share > steady


def test_admission_reads_the_batchers_queues_at_each_question():
    source = Source()
    a, _, _ = admission(source)
    first = a.snapshot(NOW)
    assert (first.now, first.rate, first.chunk_tokens, first.long, first.full) == (NOW, 1_000, CHUNK, (), False)
    e = entry(2_000, NOW)
    source.set(whole((300, NOW)), ((e, NOW + 2),), full=True)
    later = a.snapshot(NOW)
    assert later.whole.live_tokens == 300 and later.long == ((e, NOW + 2),) and later.full
    assert later.chunked(1_001) and not later.chunked(1_000)


def test_admission_counts_each_refusal_it_answers_and_the_evictions():
    source = Source()
    a, metrics, _ = admission(source)
    now = time.monotonic()
    source.set(whole(*[(300, now)] * 15))                             # 4.5 s of short work
    with pytest.raises(Refused) as no:
        a.admit(400, now)
    assert no.value.refusal.reason is Reason.QUEUED_WORK and refused(metrics, "queued_work") == 1
    large = entry(4_000, now)
    source.set(long=((entry(1_500, now), now + 1.5), (large, now + 4)), full=True)
    decision = a.admit(300, now)                                      # admitted, the largest one evicted
    assert decision.evict.entry is large and refused(metrics, "evicted") == 1
    with pytest.raises(Refused) as no:
        raise a.queue_full(300, 2.0)          # admitted into a queue that had no room: a policy may do that
    assert no.value.refusal == Refusal(Reason.QUEUE_FULL, 1, 0.0, 2.0) and refused(metrics, "queue_full") == 1
    first, second = entry(2_000, now - 20), entry(3_000, now - 20)
    first.answer_by = second.answer_by = now - 10                     # both well past their promise
    source.set(long=((first, now - 18), (second, now - 17)))
    assert [e.entry for e in a.late(now)] == [first, second] and refused(metrics, "evicted") == 3
    assert metrics.registry.get_sample_value("clef_requests_rejected_total",
                                             {"reason": "queued_work", "size": "1024"}) == 1


def test_body_sizer_learns_bytes_per_token_and_spans_its_error():
    sizer = BodySizer()
    assert sizer.estimates(4_000) == ()              # nothing measured yet: no estimate, no early refusal
    sizer.observe(4_000, 1_000)
    assert sizer.estimates(8_000) == (1_000, 2_000, 4_000)   # one sample: half to twice the guess
    sizer.observe(None, 10)                          # a compressed body's size is not a sample
    sizer.observe(6_000, 1_000)
    assert sizer.estimates(8_000) == (800, 1_600, 3_200)     # the median of 4 and 6 bytes per token
    assert sizer.estimates(0) == ()
    # the answers kept between samples, more sizes than are kept: each as a fresh sizer gives it
    fresh = BodySizer()
    fresh.observe(4_000, 1_000)
    fresh.observe(6_000, 1_000)
    for size in range(1_000, 1_000 + 3 * BodySizer.MEMO):
        assert sizer.estimates(size) == fresh.estimates(size)
    assert sizer.estimates(8_000) == (800, 1_600, 3_200)


def test_body_sizer_narrows_its_span_to_the_spread_of_bodies_of_a_similar_size():
    sizer = BodySizer()
    for ratio in (3.9, 4.0, 4.1, 4.0, 3.95, 4.05, 4.0, 4.0):
        sizer.observe(4_000, round(4_000 / ratio))
    lo, mid, hi = sizer.estimates(4_000)
    spread = [4_000 / round(4_000 / r) for r in (3.9, 4.0, 4.1)]   # the samples' own bytes per token
    assert mid == 1_000
    assert lo == round(1_000 * 4.0 / (max(spread) * 1.1)) and hi == round(1_000 * 4.0 / (min(spread) * 0.9))
    assert 880 <= lo < 900 and 1_130 < hi <= 1_145
    # bodies 100x larger say nothing about the span of a small one: it falls back to half to twice
    far = BodySizer()
    for _ in range(20):
        far.observe(400_000, 100_000)
    assert far.estimates(4_000) == (500, 1_000, 2_000)
    # scattered samples (mixed clients, images) never widen it past half to twice
    wide = BodySizer()
    for ratio in (1.0, 16.0) * 8:
        wide.observe(4_000, round(4_000 / ratio))
    guess = 4_000 / 8.5
    assert wide.estimates(4_000) == tuple(round(guess * f) for f in (0.5, 1.0, 2.0))


def test_a_narrow_span_refuses_unread_what_half_the_size_would_let_through():
    now = time.monotonic()
    source = Source()
    source.set(whole(*[(400, now - 0.05)] * 10))     # 4 s of short work that came 50 ms ago
    (young, young_metrics, _), (alike, alike_metrics, _) = admission(source), admission(source)
    young.on_prepared(None, 1_600, 400)              # one sample: the span is 0.5x to 2x
    for _ in range(8):
        alike.on_prepared(None, 1_600, 400)          # 4 bytes per token, every time: 0.91x to 1.11x
    # 400 tokens wait behind all of it (4.4 s against 2.4 s); 200 would sort ahead of it (0.2 s)
    assert young.on_arrival(1_600) is not None
    with pytest.raises(Refused) as no:
        alike.on_arrival(1_600)
    assert no.value.refusal.reason is Reason.QUEUED_WORK
    assert refused(alike_metrics, "queued_work") == 1 and refused(young_metrics, "queued_work") == 0


def test_bodies_being_prepared_count_against_later_arrivals_no_smaller_until_released():
    """A burst that finds the queue empty: 400-token bodies (1,600 bytes, 0.4 s each) pass the check on arrival
    while the held ones' work fits the 2.4 s budget: six of them (the sixth's low estimate, 364 tokens, waits
    2.364 s of 2.364 s). The seventh is refused unread, not after the tokenizer. A smaller body does not count
    the larger held ones; released holds count no more; a prepared body's hold goes."""
    a, metrics, _ = admission()                      # 1,000 tokens/s
    for _ in range(8):
        a.on_prepared(None, 1_600, 400)              # 4 bytes per token, every time: 0.91x to 1.11x
    holds = [a.on_arrival(1_600) for _ in range(6)]
    assert [h.tokens for h in holds] == [400] * 6 and held(metrics) == 2_400
    with pytest.raises(Refused) as no:
        a.on_arrival(1_600)
    assert no.value.refusal.reason is Reason.QUEUED_WORK and no.value.refusal.wait_s == pytest.approx(2.8)
    small = a.on_arrival(800)                        # ~200 tokens: none of the held bodies is ahead of it
    assert small.tokens == 200
    a.release(small)
    a.release(holds[0])
    a.release(holds[0])                              # twice is harmless
    assert held(metrics) == 2_000
    a.release(a.on_arrival(1_600))
    a.on_prepared(holds[1], 1_600, 400)              # prepared: it no longer holds
    assert held(metrics) == 1_600
    assert a.on_arrival(None) is None and a.on_arrival(0) is None    # no estimate: nothing held
    a.release(None)
    assert refused(metrics, "queued_work") == 1


def test_early_refusal_needs_every_size_in_the_estimates_span_refused_and_counts_it():
    source = Source()
    a, metrics, _ = admission(source)                # 1,000 tokens/s
    a.on_prepared(None, 4_000, 1_000)                # 4 bytes per token
    now = time.monotonic()
    source.set(whole(*[(300, now - 10)] * 10))       # 3 s of short work, aged ahead of any newcomer
    with pytest.raises(Refused) as no:
        a.on_arrival(400)                            # ~100 tokens: 3.05 to 3.2 s against 2.05 to 2.2 s
    assert no.value.refusal.reason is Reason.QUEUED_WORK and refused(metrics, "queued_work") == 1
    a.release(a.on_arrival(10_000))                  # ~2,500 tokens: chunked, they wait for its aging anyway
    long = entry(30_000, now - 40)                   # 30 s of a long prompt ahead of any newcomer
    source.set(whole(*[(300, now - 10)] * 10), ((long, now - 10),))
    # ~2,500 tokens behind all of it at each size: 1,250 (34.25 s of 8.25 s), 2,500 (35.5 of 14.5 s) and 5,000
    # (38 of 27 s) refused
    with pytest.raises(Refused):
        a.on_arrival(10_000)
    source.set()                                     # nothing queued: whatever its size, it is read
    a.release(a.on_arrival(10_000))
    a.release(a.on_arrival(400))
    assert a.on_arrival(None) is None                # size unknown (compressed) and the queue not full
    assert refused(metrics, "queued_work") == 2
    source.set(full=True)                            # full, and nothing queued gives way: refused unread
    with pytest.raises(Refused) as no:
        a.on_arrival(None)
    assert no.value.refusal.reason is Reason.QUEUE_FULL and refused(metrics, "queue_full") == 1


@pytest.mark.parametrize("refusal, says", [
    (Refusal("queued_work", 3, 4.5, 2.0), "the work already queued"),
    (Refusal("evicted", 3, 4.5, 2.0), "cheaper work admitted since this request was queued"),
    (Refusal("queue_full", 2, 0.0, 0.0), "(64 requests)"),      # a full queue names its bound, and no wait
])
def test_a_refusal_answers_429_with_its_own_reason(refusal, says):
    """An evicted request waited before its 429: the body says so (its reason was once reported as queued_work,
    which hid the evictions from clients and from loadtest's refusal latencies)."""
    error = errors.refused(refusal, capacity=64)
    body = error.bare_body()["error"]
    assert error.status == 429 and error.headers["Retry-After"] == str(refusal.retry_after_s)
    assert body["reason"] == refusal.reason.value and says in body["message"]
    assert body.get("expected_wait_s") == (None if refusal.reason is Reason.QUEUE_FULL else 4.5)


# --- the batcher, doing what admission answers ----------------------------------------------------------------

class HeldDevice:
    """A device whose forwards end when the test says (``go``), and its chunk steps one at a time (``steps``),
    reporting them at 1,000 tokens/s."""

    def __init__(self):
        self.status = FAKE_STATUS
        self.batches: list[list[str]] = []
        self.go = asyncio.Event()
        self.steps = asyncio.Semaphore(0)
        self.left = 0

    async def infer(self, prepared):
        self.batches.append([p.name for p in prepared])
        await self.go.wait()
        return [({"prompt": p.name}, None) for p in prepared], sum(p.num_tokens for p in prepared) / 1_000

    async def step(self, prepared, tokens, images=0):
        if prepared is not None:
            self.left = prepared.num_tokens
        await self.steps.acquire()
        tokens = min(tokens, self.left)
        self.left -= tokens
        return Step(self.left == 0, {} if self.left == 0 else None, tokens, self.left, None, tokens / 1_000)

    async def drop(self):
        self.left = 0


def fake_clock(monkeypatch) -> SimpleNamespace:
    clock = SimpleNamespace(t=0.0)
    monkeypatch.setattr("clefcore.server.batcher.time", SimpleNamespace(monotonic=lambda: clock.t))
    return clock


def test_a_full_queue_gives_up_its_largest_long_prompt_for_a_smaller_request():
    b, metrics = batcher(max_queue=2)

    async def main():
        deadline = time.monotonic() + 60
        small, large = (asyncio.ensure_future(b.submit(Prepared(num_tokens=n), deadline)) for n in (1_500, 4_000))
        await asyncio.sleep(0)
        assert b.full()
        assert b.admission.on_arrival(None) is None     # size unknown, a long prompt could make room: read
        with pytest.raises(Refused) as no:                        # nothing queued is larger
            await b.submit(Prepared(num_tokens=5_000), deadline)
        assert no.value.refusal.reason is Reason.QUEUE_FULL
        short = asyncio.ensure_future(b.submit(Prepared(num_tokens=300), deadline))
        await asyncio.sleep(0)                                     # the 4,000-token one made room
        with pytest.raises(Refused) as no:
            await large
        assert no.value.refusal.reason is Reason.EVICTED
        assert not small.done() and not short.done() and b.queued == 2
        assert [e.tokens for e, _ in b.admission.snapshot().long] == [1_500]
        for task in (small, short):
            task.cancel()
        await asyncio.gather(small, short, return_exceptions=True)

    asyncio.run(main())
    assert refused(metrics, "queue_full") == 1 and refused(metrics, "evicted") == 1


class AdmitAll:
    """A policy that admits everything, with no promise, even into a full queue; between steps it evicts the
    queued long prompts of ``LATE`` tokens."""
    LATE = 2_000

    def __init__(self, budgets: Budgets):
        self.budgets = budgets

    def decide(self, tokens, view, held=0.0):
        return Admit(math.inf)

    def unread(self, estimates, view, held):
        return None

    def late(self, view):
        return [Eviction(e, Refusal("evicted", 2, 11.0, 8.0)) for e, _ in view.long if e.tokens == self.LATE]


def admitting_all() -> tuple[list[AdmitAll], Callable[[Budgets], AdmitAll]]:
    built: list[AdmitAll] = []

    def factory(budgets: Budgets) -> AdmitAll:
        built.append(AdmitAll(budgets))
        return built[-1]
    return built, factory


def test_a_policy_that_admits_into_a_full_queue_gets_its_request_refused_as_queue_full():
    built, factory = admitting_all()
    b, metrics = batcher(max_queue=1, policy=factory)
    assert [policy.budgets for policy in built] == [BUDGETS]

    async def submit_two():
        deadline = time.monotonic() + 60
        first = asyncio.ensure_future(b.submit(Prepared(num_tokens=100), deadline))
        await asyncio.sleep(0)
        with pytest.raises(Refused) as full:
            await b.submit(Prepared(num_tokens=100), deadline)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        return full.value.refusal

    refusal = asyncio.run(submit_two())
    assert refusal.reason is Reason.QUEUE_FULL and refusal.budget_s == math.inf
    assert refused(metrics, "queue_full") == 1


def test_the_long_prompts_admission_finds_late_are_refused_before_the_next_step():
    """Between steps the batcher asks admission which queued long prompts are too late and refuses those
    (counted as evicted); the others stay queued."""
    _, factory = admitting_all()
    device = HeldDevice()
    b, metrics = batcher([device], policy=factory)

    async def main():
        deadline = time.monotonic() + 60
        late, kept = (asyncio.ensure_future(b.submit(Prepared(num_tokens=n, name=str(n)), deadline))
                      for n in (AdmitAll.LATE, 3_000))
        short = asyncio.ensure_future(b.submit(Prepared(num_tokens=100, name="short"), deadline))
        await asyncio.sleep(0)
        assert b.queued == 3
        b.start()
        await asyncio.sleep(0.01)                   # the lane asked, then took the short one: held on the device
        with pytest.raises(Refused) as no:
            await late
        assert no.value.refusal == Refusal("evicted", 2, 11.0, 8.0)
        assert device.batches == [["short"]] and not kept.done() and b.queued == 1
        assert [e.tokens for e, _ in b.admission.snapshot().long] == [3_000]
        kept.cancel()
        device.go.set()
        await short
        await b.stop()

    asyncio.run(main())
    assert refused(metrics, "evicted") == 1


def test_the_batcher_tells_admission_of_its_lanes_step_and_chunked_run(monkeypatch):
    """A 3,000-token prompt queued, then run chunked: admission reads its order key while it waits, and while a
    chunk runs the lane's step (its tokens and start), what the run has left and its next chunk's key (the
    step's expected end, then a chunk's aging); the step measures the rate."""
    clock = fake_clock(monkeypatch)
    device = HeldDevice()
    b, _ = batcher([device])

    async def main():
        run = asyncio.ensure_future(b.submit(Prepared(num_tokens=3_000, name="long"), 60.0))
        await asyncio.sleep(0)
        queued = b.admission.snapshot(0.0)
        assert [(e.tokens, key) for e, key in queued.long] == [(3_000, 3.0)] and queued.lanes == (IDLE,)
        b.start()
        await asyncio.sleep(0.01)
        assert b.admission.snapshot(0.0).lanes == (LaneView(1_000, 0.0, 3_000, 2.0),)
        assert b.admission.snapshot(0.0).long == ()
        clock.t = 1.0
        device.steps.release()
        await asyncio.sleep(0.01)                    # the next chunk started at 1.0, due to end at 2.0
        assert b.admission.snapshot(1.0).lanes == (LaneView(1_000, 1.0, 2_000, 3.0),)
        assert b.admission.rate == 1_000
        device.steps.release()
        device.steps.release()
        await run
        await b.stop()

    asyncio.run(main())


def test_a_batch_is_cut_where_it_would_end_past_a_kept_promise(monkeypatch):
    """Each admitted request is promised its answer by the end of its budget (1 s here). Requests that queued
    behind a running step go in a batch that still ends by every promise it can keep, at the measured rate; one
    already late joins without cutting it."""
    clock = fake_clock(monkeypatch)
    device = HeldDevice()

    async def main():
        b, _ = batcher([device], max_batch_tokens=10_000, chunk_tokens=0)
        b.start()

        def send(name):
            return asyncio.ensure_future(b.submit(Prepared(num_tokens=100 if name == "first" else 300, name=name),
                                                  clock.t + 60))

        device.go.set()
        await send("warm")               # its step measures the rate: 1,000 tokens/s
        device.go.clear()
        first = send("first")
        await asyncio.sleep(0.01)        # "first" is on the device, held there
        a = send("a")                    # t 0: 100 left of the step + 300: 0.4 s, promised by 1.0
        await asyncio.sleep(0)
        clock.t = 0.5
        rest = [send("b"), send("c")]    # t 0.5: 0.6 s and 0.9 s, promised by 1.5
        await asyncio.sleep(0.01)
        clock.t = 0.8
        device.go.set()                  # the next batch starts at 0.8: a ends at 1.1 (late anyway), b at 1.4,
        await asyncio.gather(first, a, *rest)   # c would end at 1.7, past b's 1.5: cut before c
        await b.stop()

    asyncio.run(main())
    assert device.batches == [["warm"], ["first"], ["a", "b"], ["c"]]
