"""Admission by work (server/admission.py): the measured rate, the budget check and Retry-After."""

from __future__ import annotations

import math

import pytest

from clefcore.server.admission import RateMeter, check, expected_wait, retry_after


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
