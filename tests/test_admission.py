"""Admission by work (server/admission.py): the measured rate, the budget check and Retry-After."""

from __future__ import annotations

import math

import pytest

import time
from types import SimpleNamespace

from clefcore.scheduler import Entry
from clefcore.server.admission import (MIN_BUDGET_S, BodySizer, RateMeter, budget, check, expected_wait,
                                      retry_after)
from clefcore.server.batcher import Batcher


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


def test_check_admits_within_the_budget_and_an_idle_device_always():
    assert check(0, 10**6, rate=1_000, budget_s=1.0) is None  # alone: however long, it runs
    assert check(500, 400, rate=1_000, budget_s=1.0) is None  # 0.9 s
    refusal = check(500, 600, rate=1_000, budget_s=1.0)       # 1.1 s
    assert refusal.reason == "queued_work" and refusal.wait_s == pytest.approx(1.1)
    assert refusal.retry_after_s == 1
    refusal = check(10_000, 100, rate=1_000, budget_s=2.0)    # 10.1 s: fits again in ~8.1 s
    assert refusal.retry_after_s == 9


def test_wait_and_retry_after_edges():
    assert expected_wait(0, 1_000) == 0.0
    assert retry_after(0, 1_000, 5.0) == 1
    assert retry_after(3_500, 1_000, 1.0) == math.ceil(2.5)


def test_budget_grows_with_the_request_between_the_floor_and_the_cap():
    assert budget(10, rate=1_000, slowdown=4, cap_s=10) == MIN_BUDGET_S     # 4 x 0.01 s is below the floor
    assert budget(500, rate=1_000, slowdown=4, cap_s=10) == pytest.approx(2.0)
    assert budget(5_000, rate=1_000, slowdown=4, cap_s=10) == 10           # 20 s, capped
    assert budget(0, rate=1_000, slowdown=math.inf, cap_s=7) == 7           # inf: the cap alone


def batcher(**kw) -> Batcher:
    options = dict(max_queue=64, max_batch_tokens=4096, max_batch_requests=8, hooks=None, wait_budget_s=10.0,
                   slowdown=4.0, chunk_tokens=1_000, age_rate=None, start_rate=1_000.0)
    options.update(kw)
    return Batcher(SimpleNamespace(device="cpu"), None, None, **options)


def test_a_request_counts_only_the_work_that_runs_before_it():
    b = batcher()  # 1,000 tokens/s, chunks of 1,000 tokens, aging at the rate
    now = time.monotonic()
    b._long.push(Entry(None, 8_000, now + 60, now))  # 8 s of chunked work accepted
    # A longer prompt runs after it (shortest first): 8 s + its own 9 s is past the 10 s cap; a shorter one
    # passes it, and with nothing before it is admitted however long.
    refused = b.refusal(9_000)
    assert refused is not None and refused.reason == "queued_work" and refused.retry_after_s >= 7
    assert b.tokens_ahead(5_000) == 0 and b.refusal(5_000) is None
    # A short one passes the queued chunk (due at now + 1 s): nothing runs before it.
    assert b.tokens_ahead(100) == 0 and b.refusal(100) is None
    for _ in range(3):
        b._scheduler.push(Entry(None, 300, now + 60, now))
    assert b.tokens_ahead(100) == 0          # shortest first: it goes before the three 300-token ones
    assert b.tokens_ahead(400) == 900        # they arrived first and are smaller
    assert b.refusal(400) is None            # (900 + 400) / 1000 = 1.3 s <= 4 x 0.4 s
    assert b.refusal(150) is None and b.refusal(None) is None
    b._running_tokens = 2_000                 # a 2 s batch on the device now: every short one waits for it
    assert b.tokens_ahead(100) == 2_000
    refused = b.refusal(100)                  # 2.1 s > max(0.25 s, 4 x 0.1 s)
    assert refused is not None and refused.budget_s == pytest.approx(0.4)
    assert b.refusal(None) is None            # the cheap check: a larger request could still fit


def test_the_next_chunk_counts_for_a_short_request_once_it_is_due():
    b = batcher()
    now = time.monotonic()
    b._long.push(Entry(None, 8_000, now + 60, now - 5))  # due since now - 4 s
    assert b.tokens_ahead(100) == 1_000
    b._running_tokens = 20_000                # the step on the device alone is past the 10 s cap
    refused = b.refusal(None)
    assert refused is not None and refused.reason == "queued_work"


def test_body_sizer_learns_bytes_per_token_and_spans_its_error():
    sizer = BodySizer()
    assert sizer.estimates(4_000) == ()              # nothing measured yet: no estimate, no early refusal
    sizer.observe(4_000, 1_000)
    assert sizer.estimates(8_000) == (1_000, 2_000, 4_000)
    sizer.observe(None, 10)                          # a compressed body's size is not a sample
    sizer.observe(6_000, 1_000)                      # 6 bytes per token moves the mean a tenth of the way
    assert sizer.bytes_per_token == pytest.approx(4.2)
    assert sizer.estimates(0) == ()


def test_early_refusal_needs_every_size_in_the_estimates_span_refused():
    b = batcher()                                   # 1,000 tokens/s
    b.sizer.observe(4_000, 1_000)                   # 4 bytes per token
    b._running_tokens = 2_000                       # 2 s on the device before any short request
    # a ~100-token body: refused at 50, 100 and 200 tokens (budgets 0.25 to 0.8 s) -> refused unread
    refused = b.early_refusal(400)
    assert refused is not None and refused.reason == "queued_work"
    # a ~500-token body: at 1,000 tokens the 4 s budget fits the 3 s wait, so it is read and checked exactly
    assert b.early_refusal(2_000) is None and b.refusal(1_000) is None
    assert b.early_refusal(None) is None            # size unknown (compressed): only the cheap check
