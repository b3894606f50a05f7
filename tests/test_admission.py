"""Admission by cost (server/admission.py, server/batcher.py): the measured rate, the budgets, the work
counted before a request, evictions and Retry-After, against hand-worked numbers."""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

import pytest

from clefcore.engine import EngineStatus
from clefcore.scheduler import Entry
from clefcore.server.admission import (Admit, BodySizer, Budgets, RateMeter, RecentShare, Refusal,
                                      retry_after, size_class)
from clefcore.server.batcher import Batcher, QueueFull
from clefcore.server.device_watch import DeviceWatch
from clefcore.server.metrics import Metrics


def test_rate_meter_starts_at_its_guess_and_follows_the_device():
    meter = RateMeter(2_000)
    assert meter.rate == 2_000
    meter.observe(1_000, 0.1)  # the first sample replaces the guess
    assert meter.rate == pytest.approx(10_000)
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


def test_until_the_rate_is_measured_work_is_judged_against_the_largest_budget_only():
    loop = asyncio.new_event_loop()
    b = batcher()
    b._rate.samples = 0
    now = time.monotonic()
    for _ in range(10):
        b._scheduler.push(entry(loop, 300, now - 10))      # 3 s ahead at the start value
    assert b.policy.refusal(400, b.view(now)) is None   # 3.4 s, within the 10 s of the largest budget
    for _ in range(30):
        b._scheduler.push(entry(loop, 300, now - 10))      # 12 s ahead
    assert b.policy.refusal(400, b.view(now)).budget_s == 10.0
    b._rate.observe(1_000, 1.0)                            # measured: 1,000 tokens/s, as guessed
    assert b.policy.refusal(400, b.view(now)).budget_s == pytest.approx(2.4)   # a step, a chunk and its own 400
    loop.close()


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
    assert Refusal("queue_full", 1, 0.0, 0.0).reason == "queue_full"
    with pytest.raises(ValueError, match="reason must be one of queued_work, queue_full, evicted, got 'busy'"):
        Refusal("busy", 1, 0.0, 0.0)


def test_retry_after_and_size_classes():
    assert retry_after(2.5, 1.0, 15.0) == 2
    assert retry_after(1.1, 1.0, 15.0) == 1          # at least 1 s
    assert retry_after(1e9, 1.0, 15.0) == 15         # at most the cap
    assert [size_class(n) for n in (None, 1, 1_024, 1_025, 9_000, 30_000)] == [
        "unknown", "1024", "1024", "2048", "16384", "+Inf"]


class Prepared(SimpleNamespace):
    images = ()     # text only: its cost is its tokens


def batcher(**kw) -> Batcher:
    """1,000 tokens/s, steps (batches and chunks) of 1,000 tokens, aging at 1,000 tokens/s, budgets of 1 s up to
    10 s at 10,000 tokens."""
    options = dict(max_queue=64, max_batch_tokens=1_000, max_batch_requests=8,
                   budgets=Budgets(1.0, 10.0, 10_000), chunk_tokens=1_000, age_rate=1_000.0, start_rate=1_000.0)
    options.update(kw)
    metrics = Metrics()
    watch = DeviceWatch(metrics, 30.0, 60.0, on_change=lambda trouble: None, on_expired=lambda trouble: None)
    b = Batcher([None], metrics, watch=watch, **options)   # one lane, no device process: arithmetic only
    b._rate.samples = 1  # as if measured: the start value stands
    return b


def entry(loop, tokens: int, at: float) -> Entry:
    return Entry((Prepared(num_tokens=tokens), loop.create_future()), tokens, at + 60, at)


def queue_long(b: Batcher, e: Entry) -> None:
    """Queue ``e`` as a long prompt admitted when it arrived: promised by the end of its budget then."""
    e.answer_by = e.enqueued_at + b.policy.budget(e.tokens, b.view())
    b._long_keys[e] = b._long.key(e.tokens, e.enqueued_at)
    assert b._long.push(e)


def refused(b: Batcher, reason: str) -> float:
    return sum(s.value for m in b._metrics.rejected.collect() for s in m.samples
               if s.name.endswith("_total") and s.labels["reason"] == reason)


def test_queued_long_prompts_do_not_count_against_a_short_one():
    loop = asyncio.new_event_loop()
    b = batcher()
    now = time.monotonic()
    queue_long(b, entry(loop, 8_000, now))              # 8 s of long work queued, not started
    assert b.policy.expected_wait(100, b.view(now)) == pytest.approx(0.1)
    assert b.policy.refusal(100, b.view(now)) is None
    for _ in range(3):
        b._scheduler.push(entry(loop, 300, now))
    assert b.policy.expected_wait(100, b.view(now)) == pytest.approx(0.1)   # shortest first: ahead of the three
    assert b.policy.expected_wait(400, b.view(now)) == pytest.approx(1.3)    # behind them: 900 + its own 400
    # a long one behind: every whole prompt, the long one before it (shorter), its own, over the device
    assert b.policy.expected_wait(9_000, b.view(now)) == pytest.approx((900 + 8_000 + 9_000) / 1_000)
    loop.close()


def test_a_short_request_counts_what_is_left_of_the_running_step_and_is_never_refused_for_it_alone():
    b = batcher(chunk_tokens=0, max_batch_tokens=4_000)
    now = time.monotonic()
    lane = b._lanes[0]
    lane.running = [object()]
    lane.step_tokens, lane.step_started = 4_000, now - 1.0     # a 4 s step, 1 s done
    assert b.policy.expected_wait(100, b.view(now)) == pytest.approx(3.1)      # 3,000 left + its own
    assert b.policy.budget(100, b.view()) == pytest.approx(4.1)   # that step + its own, over the 1 s floor
    assert b.policy.refusal(100, b.view(now)) is None


def test_the_started_runs_next_chunk_counts_once_it_is_due():
    b = batcher()
    now = time.monotonic()
    b._lanes[0].active = SimpleNamespace(ready_at=now - 5, tokens_left=5_000)   # due since long ago
    assert b.policy.expected_wait(100, b.view(now)) == pytest.approx(1.1)   # one chunk of 1,000, not the 5,000 left
    b._lanes[0].active.ready_at = now                           # just stepped: due in 1 s
    assert b.policy.expected_wait(100, b.view(now)) == pytest.approx(0.1)


def test_over_budget_a_short_request_is_refused_with_retry_after():
    loop = asyncio.new_event_loop()
    b = batcher()
    now = time.monotonic()
    for _ in range(15):
        b._scheduler.push(entry(loop, 300, now))               # 4.5 s of short work
    refusal = b.policy.refusal(400, b.view(now))
    assert refusal.reason == "queued_work" and refusal.wait_s == pytest.approx(4.9)
    # what the order alone may make it wait: a step, the next chunk and its own, over the 1 s floor
    assert refusal.budget_s == pytest.approx(2.4)
    assert refusal.retry_after_s == 3
    loop.close()


def whole_prompts_kept_coming(b: Batcher, now: float) -> float:
    """Whole prompts were waiting through the last 10 s of steps: the share of time they waited, nearly 1."""
    t = now - 10.0
    b._whole_waiting.step(t, 0.0)
    while t < now:
        t += 0.1
        b._whole_waiting.step(t, 0.1)
    return b._whole_waiting.share(now)


def test_a_long_prompt_counts_the_shorter_work_that_passes_it_while_whole_prompts_keep_coming():
    loop = asyncio.new_event_loop()
    b = batcher()
    now = time.monotonic()
    b._scheduler.push(entry(loop, 300, now))
    # the order alone: its aging (5 s), a step and a chunk, then its run, twice its tokens' time while whole
    # prompts keep coming (each 1,000-token chunk lets pass what arrives within its aging: 1 s of work)
    assert b.policy.slow(b.view()) == 2.0
    assert b.policy.budget(5_000, b.view()) == pytest.approx(5 + 2 + 10)
    # none came lately: the whole prompt whose key comes first (0.3 s), then its own 5 s
    assert b.policy.expected_wait(5_000, b.view(now)) == pytest.approx(5.3)
    share = whole_prompts_kept_coming(b, now)
    assert share > 0.99
    # they keep coming: it starts when its key comes up (5 s), and runs in 10 s
    assert b.policy.expected_wait(5_000, b.view(now)) == pytest.approx((1 - share) * 5.3 + share * 15)
    assert b.policy.refusal(5_000, b.view(now)) is None
    # a 6,000-token prompt queued ahead of it (key now - 4) starts first and runs for 12 s meanwhile: 22 s
    queue_long(b, entry(loop, 6_000, now - 10))
    refusal = b.policy.refusal(5_000, b.view(now))
    assert refusal.reason == "queued_work"
    assert refusal.wait_s == pytest.approx((1 - share) * (0.3 + 6 + 5) + share * 22)
    assert refusal.retry_after_s == 5                           # 22 s against 17 s
    # a whole prompt is not held back by them: the first chunk of the long prompt whose key came, and its own
    assert b.policy.expected_wait(500, b.view(now)) == pytest.approx(1.8)
    assert b.policy.refusal(500, b.view(now)) is None
    loop.close()


def test_the_whole_work_queued_slows_chunked_runs_down_and_moves_a_queued_one_past_its_promise():
    """Before each chunk runs the whole work queued when it became due (here more than a chunk's aging lets
    pass): a long prompt admitted at 17 s is evicted once that work makes it more than a quarter of its budget
    late, not for any lateness (the work sorted before it swings by a step each time it is counted)."""
    loop = asyncio.new_event_loop()
    b = batcher()
    now = time.monotonic()
    share = whole_prompts_kept_coming(b, now)
    waiting = entry(loop, 5_000, now)
    queue_long(b, waiting)
    assert waiting.answer_by - now == pytest.approx(17.0)
    for _ in range(5):                                          # 1.5 s of whole work before it
        b._scheduler.push(entry(loop, 300, now))
    assert b.policy.slow(b.view()) == 2.5   # 1,500 tokens queued per 1,000-token chunk
    b._evict_late(now)                                          # 5 + 12.5 s: late by 0.5 s of 17
    assert not waiting.payload[1].done()
    for _ in range(5):                                          # 3 s: 5 + 20 s, late by 8 s
        b._scheduler.push(entry(loop, 300, now))
    b._evict_late(now)
    refusal = waiting.payload[1].exception().refusal
    assert refusal.reason == "evicted" and refusal.wait_s == pytest.approx((1 - share) * 8 + share * 25)
    loop.close()


def test_a_long_prompt_whose_key_came_counts_one_chunk_against_a_short_one():
    loop = asyncio.new_event_loop()
    b = batcher()
    now = time.monotonic()
    queue_long(b, entry(loop, 3_000, now - 2.95))               # key now + 0.05: it starts before the next one
    assert b.policy.expected_wait(100, b.view(now)) == pytest.approx(1.1)   # its first chunk, then its own 100
    assert b.policy.expected_wait(40, b.view(now)) == pytest.approx(0.04)   # key now + 0.04: this one first
    b._lanes[0].active = SimpleNamespace(ready_at=now + 10, tokens_left=500)   # the lane runs another one:
    assert b.policy.expected_wait(100, b.view(now)) == pytest.approx(0.1)      # no new one starts there
    loop.close()


def test_queued_long_prompts_past_their_budget_are_evicted_in_start_order():
    """Each counts only the long prompts kept before it: the first one's eviction lets the second one stay."""
    loop = asyncio.new_event_loop()
    b = batcher(budgets=Budgets(1.0, 20.0, 10_000))
    now = time.monotonic()
    first, second = entry(loop, 2_000, now), entry(loop, 3_000, now)
    queue_long(b, first)                                        # promised 2 + 2 + 4 = 8 s: evicted past 10 s
    queue_long(b, second)                                       # promised 3 + 2 + 6 = 11 s: past 13.75 s
    b._evict_late(now)
    assert not first.payload[1].done() and not second.payload[1].done()   # answered at 2 s and 5 s
    for _ in range(9):
        b._scheduler.push(entry(loop, 1_000, now))              # 9 s of whole work arrives before them
    b._evict_late(now)
    error = first.payload[1].exception()                        # 11 s: past 10 s
    assert isinstance(error, QueueFull) and error.refusal.reason == "evicted"
    assert error.refusal.wait_s == pytest.approx(11.0) and error.refusal.retry_after_s >= 1
    assert not second.payload[1].done()                         # 12 s without the first (14 s with it)
    assert b.queued == 10 and list(b._long_keys) == [second]
    assert refused(b, "evicted") == 1
    loop.close()


def test_a_full_queue_gives_up_its_largest_long_prompt_for_a_smaller_request():
    loop = asyncio.new_event_loop()
    b = batcher(max_queue=2)
    now = time.monotonic()
    small, large = entry(loop, 1_500, now), entry(loop, 4_000, now)
    queue_long(b, small)
    queue_long(b, large)
    assert b.full()
    assert b.policy.refusal(5_000, b.view(now)).reason == "queue_full"         # nothing queued is larger
    assert b.policy.refusal(300, b.view(now)) is None   # the 4,000-token one would make room

    async def submit():
        task = asyncio.ensure_future(b.submit(Prepared(num_tokens=300), now + 60))
        await asyncio.sleep(0)
        return task

    task = loop.run_until_complete(submit())
    assert large.payload[1].exception().refusal.reason == "evicted"
    assert not small.payload[1].done() and b.queued == 2
    task.cancel()
    loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
    loop.close()


class AdmitAll:
    """A policy that admits everything, with no promise and no eviction, even into a full queue."""

    def __init__(self, budgets: Budgets):
        self.budgets = budgets

    def decide(self, tokens, view, held=0.0):
        return Admit(math.inf)

    def unread(self, estimates, view, held):
        return None

    def late(self, view):
        return []


def test_a_policy_that_admits_into_a_full_queue_gets_its_request_refused_as_queue_full():
    loop = asyncio.new_event_loop()
    b = batcher(max_queue=1, policy=AdmitAll)
    assert isinstance(b.policy, AdmitAll) and b.policy.budgets == Budgets(1.0, 10.0, 10_000)
    now = time.monotonic()

    async def submit_two():
        first = asyncio.ensure_future(b.submit(Prepared(num_tokens=100), now + 60))
        await asyncio.sleep(0)
        with pytest.raises(QueueFull) as full:
            await b.submit(Prepared(num_tokens=100), now + 60)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        return full.value.refusal

    refusal = loop.run_until_complete(submit_two())
    assert refusal.reason == "queue_full" and refusal.budget_s == math.inf
    assert refused(b, "queue_full") == 1
    loop.close()


def test_body_sizer_learns_bytes_per_token_and_spans_its_error():
    sizer = BodySizer()
    assert sizer.estimates(4_000) == ()              # nothing measured yet: no estimate, no early refusal
    sizer.observe(4_000, 1_000)
    assert sizer.estimates(8_000) == (1_000, 2_000, 4_000)   # one sample: half to twice the guess
    sizer.observe(None, 10)                          # a compressed body's size is not a sample
    sizer.observe(6_000, 1_000)
    assert sizer.estimates(8_000) == (800, 1_600, 3_200)     # the median of 4 and 6 bytes per token
    assert sizer.estimates(0) == ()
    # the answers kept between samples: as many sizes as MEMO at most, each as a fresh sizer would give it
    fresh = BodySizer()
    fresh.observe(4_000, 1_000)
    fresh.observe(6_000, 1_000)
    for size in range(1_000, 1_000 + 3 * BodySizer.MEMO):
        assert sizer.estimates(size) == fresh._estimate(size)
    assert len(sizer._memo) <= BodySizer.MEMO


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
    loop = asyncio.new_event_loop()
    now = time.monotonic()
    young, alike = batcher(), batcher()              # 1,000 tokens/s
    young.sizer.observe(1_600, 400)                  # one sample: the span is 0.5x to 2x
    for _ in range(8):
        alike.sizer.observe(1_600, 400)              # 4 bytes per token, every time: 0.91x to 1.11x
    for b in (young, alike):
        for _ in range(10):                          # 4 s of short work that came 50 ms ago
            b._scheduler.push(entry(loop, 400, now - 0.05))
    # 400 tokens wait behind all of it (4.4 s against 2.4 s); 200 would sort ahead of it (0.2 s)
    assert young.early_refusal(1_600) is None
    refusal = alike.early_refusal(1_600)
    assert refusal is not None and refusal.reason == "queued_work"
    assert refused(alike, "queued_work") == 1 and refused(young, "queued_work") == 0
    loop.close()


def test_bodies_being_prepared_count_against_later_arrivals_no_smaller_until_released():
    """A burst that finds the queue empty: 400-token bodies (1,600 bytes, 0.4 s each) pass the check on arrival
    while the held ones' work fits the 2.4 s budget: six of them (the sixth's low estimate, 364 tokens, waits
    2.364 s of 2.364 s). The seventh is refused unread, not after the tokenizer. A smaller body does not count
    the larger held ones; released holds count no more."""
    b = batcher()                                    # 1,000 tokens/s
    for _ in range(8):
        b.sizer.observe(1_600, 400)                  # 4 bytes per token, every time: 0.91x to 1.11x
    holds = []
    for _ in range(6):
        assert b.early_refusal(1_600) is None
        holds.append(b.hold(1_600))
    assert [h.tokens for h in holds] == [400] * 6
    refusal = b.early_refusal(1_600)
    assert refusal is not None and refusal.reason == "queued_work" and refusal.wait_s == pytest.approx(2.8)
    assert b.early_refusal(800) is None              # ~200 tokens: none of the held bodies is ahead of it
    b.release(holds[0])
    b.release(holds[0])                              # twice is harmless
    assert b.early_refusal(1_600) is None
    assert b.hold(None) is None and b.hold(0) is None    # no estimate: nothing held
    b.release(None)
    assert refused(b, "queued_work") == 1


def test_early_refusal_needs_every_size_in_the_estimates_span_refused_and_counts_it():
    loop = asyncio.new_event_loop()
    b = batcher()                                   # 1,000 tokens/s
    b.sizer.observe(4_000, 1_000)                   # 4 bytes per token
    now = time.monotonic()
    for _ in range(10):
        b._scheduler.push(entry(loop, 300, now - 10))   # 3 s of short work, aged ahead of any newcomer
    refusal = b.early_refusal(400)                  # ~100 tokens: 3.05 to 3.2 s against 2.05 to 2.2 s
    assert refusal is not None and refusal.reason == "queued_work"
    assert refused(b, "queued_work") == 1
    assert b.early_refusal(10_000) is None          # ~2,500 tokens: chunked, they wait for its aging anyway
    queue_long(b, entry(loop, 30_000, now - 40))    # 30 s of a long prompt ahead of any newcomer
    # ~2,500 tokens behind all of it at each size: 1,250 (34.25 s of 8.25 s), 2,500 (35.5 of 14.5 s) and 5,000
    # (38 of 27 s) refused
    assert b.early_refusal(10_000) is not None
    b._scheduler = type(b._scheduler)(64, 1_000.0)   # nothing queued: whatever its size, it is read
    b._long, b._long_keys = type(b._long)(64, 1_000.0), {}
    assert b.early_refusal(10_000) is None and b.early_refusal(400) is None
    assert b.early_refusal(None) is None            # size unknown (compressed) and the queue not full
    assert refused(b, "queued_work") == 2
    loop.close()


@pytest.mark.parametrize("reason, says", [("queued_work", "the work already queued"),
                                          ("evicted", "cheaper work admitted since this request was queued")])
def test_a_refusal_for_work_answers_429_with_its_own_reason(reason, says):
    """An evicted request waited before its 429: the body says so (its reason was once reported as queued_work,
    which hid the evictions from clients and from loadtest's refusal latencies)."""
    from clefcore.server.routes import _api_error
    from clefcore.server.service import Overloaded
    error = _api_error(Overloaded(Refusal(reason, 3, 4.5, 2.0), capacity=64), {"log": {}})
    body = error.bare_body()["error"]
    assert error.status == 429 and error.headers["Retry-After"] == "3"
    assert body["reason"] == reason and body["expected_wait_s"] == 4.5 and says in body["message"]


class HeldDevice:
    """A device whose forwards end when the test says (``release``), reporting them at 1,000 tokens/s."""

    def __init__(self):
        self.status = EngineStatus("fake", "cpu", "fp32", None, {}, 0, 0)
        self.batches: list[list[str]] = []
        self.go = asyncio.Event()

    async def infer(self, prepared):
        self.batches.append([p.name for p in prepared])
        await self.go.wait()
        return [({"prompt": p.name}, None) for p in prepared], sum(p.num_tokens for p in prepared) / 1_000


def test_a_batch_is_cut_where_it_would_end_past_a_kept_promise(monkeypatch):
    """Each admitted request is promised its answer by the end of its budget (1 s here). Requests that queued
    behind a running step go in a batch that still ends by every promise it can keep, at the measured rate; one
    already late joins without cutting it."""
    clock = SimpleNamespace(t=0.0)
    monkeypatch.setattr("clefcore.server.batcher.time", SimpleNamespace(monotonic=lambda: clock.t))
    device = HeldDevice()

    async def main():
        b = batcher(max_batch_tokens=10_000, chunk_tokens=0)
        b._lanes[0].device = device
        b.start()

        def send(name):
            return asyncio.ensure_future(b.submit(Prepared(num_tokens=100 if name == "first" else 300, name=name),
                                                  clock.t + 60))

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
    assert device.batches == [["first"], ["a", "b"], ["c"]]
