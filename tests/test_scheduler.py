"""The Cython scheduler core (clefcore.scheduler): capacity, packing under a token budget and a request count
(first in first out by default, shortest first with aging given an age rate), cancelled and expired entries."""

from __future__ import annotations

import pytest

from clefcore.scheduler import Entry, Scheduler

FAR = 1e18


def entries(tokens, deadline=FAR):
    return [Entry(i, t, deadline, 0.0) for i, t in enumerate(tokens)]


def ids(batch):
    return [e.payload for e in batch.entries]


def test_capacity_counts_live_entries():
    s = Scheduler(2)
    a, b, c = entries([10, 10, 10])
    assert s.push(a) and s.push(b)
    assert s.full() and not s.push(c) and len(s) == 2
    s.cancel(a)  # a cancelled entry gives its slot back at once
    assert not s.full() and s.push(c) and len(s) == 2 and s.live_tokens == 20


def test_fifo_packing_respects_budget_and_count():
    s = Scheduler(100)
    for e in entries([300, 300, 300, 100, 100]):
        s.push(e)
    first = s.take(700, 10, 0.0)
    assert ids(first) == [0, 1] and first.tokens == 600
    assert ids(s.take(350, 10, 0.0)) == [2]     # a small request never overtakes the larger one ahead of it
    assert ids(s.take(10_000, 1, 0.0)) == [3]
    assert ids(s.take(10_000, 10, 0.0)) == [4] and len(s) == 0


def test_head_always_goes_even_over_budget():
    s = Scheduler(10)
    for e in entries([5000, 10]):
        s.push(e)
    assert ids(s.take(1000, 8, 0.0)) == [0]
    assert ids(s.take(1000, 8, 0.0)) == [1]


def test_cancelled_and_expired_entries_are_dropped_and_reported():
    s = Scheduler(10)
    a, b, c, d = entries([10, 10, 10, 10])
    b.deadline = 5.0
    for e in (a, b, c, d):
        s.push(e)
    s.cancel(c)
    s.cancel(c)  # idempotent
    batch = s.take(1000, 10, now=6.0)
    assert ids(batch) == [0, 3]
    assert [e.payload for e in batch.expired] == [1]
    assert [e.payload for e in batch.cancelled] == [2]
    assert len(s) == 0 and s.live_tokens == 0
    assert not any(e.queued for e in (a, b, c, d))
    s.cancel(a)  # cancelling an entry already taken changes nothing
    assert len(s) == 0 and s.live_tokens == 0


def test_drain_and_reuse_rules():
    s = Scheduler(4)
    a, b = entries([1, 2])
    s.push(a)
    s.push(b)
    s.cancel(a)
    assert [e.payload for e in s.drain()] == [1]
    assert len(s) == 0
    with pytest.raises(ValueError):
        s.push(a)  # cancelled entries are never queued again
    with pytest.raises(ValueError):
        Scheduler(0)
    with pytest.raises(ValueError, match="age_rate"):
        Scheduler(4, 0.0)
    with pytest.raises(ValueError):
        Entry(None, -1, FAR, 0.0)


def test_shortest_first_with_aging():
    """age_rate 1000 tokens/s: a short request passes a long one that arrived less than (difference in tokens) /
    1000 s earlier, and not one that has waited longer than that."""
    s = Scheduler(10, 1000.0)
    long_, short_late, short_too_late = (Entry("long", 5000, FAR, 0.0), Entry("short", 100, FAR, 4.0),
                                         Entry("too late", 100, FAR, 5.0))
    for e in (long_, short_late, short_too_late):
        s.push(e)
    # keys: long 0 + 5.0, short 4.0 + 0.1, too late 5.0 + 0.1
    assert ids(s.take(100, 10, 6.0)) == ["short"]
    assert ids(s.take(100, 10, 6.0)) == ["long"]           # the head always goes, over the budget too
    assert ids(s.take(100, 10, 6.0)) == ["too late"] and len(s) == 0


def test_aging_never_starves_a_long_request():
    """Short requests arriving without pause: the long one runs once its wait has paid for its size."""
    s = Scheduler(10_000, 2000.0)
    s.push(Entry("long", 8000, FAR, 0.0))
    t, order = 0.0, []
    while "long" not in order:
        t += 0.1
        s.push(Entry(f"s{t:.1f}", 50, FAR, t))
        order += ids(s.take(50, 1, t))
        assert t < 5.0, "the long request starved"
    assert 3.9 <= t <= 4.1                                  # 8000 / 2000 s behind the short stream


def test_packing_follows_the_order_and_stops_at_the_first_misfit():
    s = Scheduler(10, 1000.0)
    for e in (Entry("a", 400, FAR, 0.0), Entry("b", 300, FAR, 0.0), Entry("c", 100, FAR, 0.0),
              Entry("d", 900, FAR, 0.0)):
        s.push(e)
    assert ids(s.take(800, 10, 0.0)) == ["c", "b", "a"]
    assert ids(s.take(800, 10, 0.0)) == ["d"]


def test_set_age_rate_applies_to_new_entries_and_refuses_nonpositive():
    s = Scheduler(8)  # FIFO at first
    s.push(Entry("long", 1000, 100.0, 0.0))
    s.set_age_rate(100.0)  # from now on 1000 tokens of difference are worth 10 s of waiting
    s.push(Entry("short", 10, 100.0, 1.0))  # key 1.1: the FIFO-era entry (key 0.0) keeps its place
    s.push(Entry("later-long", 1000, 100.0, 0.5))  # key 10.5: arrived before the short one, runs after it
    order = [e.payload for e in s.take(10_000, 1, 2.0).entries + s.take(10_000, 1, 2.0).entries
             + s.take(10_000, 1, 2.0).entries]
    assert order == ["long", "short", "later-long"]
    assert s.age_rate == 100.0
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="age_rate"):
            s.set_age_rate(bad)


def test_keys_head_and_the_work_before_a_new_entry():
    s = Scheduler(10, age_rate=100.0)  # 100 tokens of priority per second waited
    assert s.head_key() == float("inf") and s.tokens_before(1e9) == 0
    a, b, c = Entry("a", 300, FAR, 0.0), Entry("b", 50, FAR, 0.0), Entry("c", 200, FAR, 2.5)
    for e in (a, b, c):
        s.push(e)
    assert s.key(300, 0.0) == 3.0 and s.key(50, 1.0) == 1.5
    assert s.head_key() == 0.5  # b: 50 tokens at t = 0
    # a new 100-token entry at t = 1 (key 2.0) runs after b (0.5), before a (3.0) and c (4.5)
    assert s.tokens_before(s.key(100, 1.0)) == 50
    assert s.tokens_before(s.key(300, 1.0)) == 50 + 300  # a's key 3.0 <= 4.0: it arrived first
    s.cancel(b)  # a cancelled entry is not work ahead, and the head moves past it
    assert s.tokens_before(s.key(100, 1.0)) == 0 and s.head_key() == 3.0
    assert ids(s.take(10_000, 10, 0.0)) == ["a", "c"]


def test_the_queued_entries_with_their_keys_in_push_order():
    """What admission weighs queued long prompts by: each live entry and its key, as pushed; cancelled, taken,
    expired and drained entries leave it."""
    s = Scheduler(10, age_rate=100.0)
    a, b = Entry("a", 300, FAR, 0.0), Entry("b", 50, FAR, 0.0)
    c, d = Entry("c", 200, 1.0, 0.5), Entry("d", 25, FAR, 0.0)
    for e in (a, b, c, d):
        s.push(e)
    assert s.keyed() == ((a, 3.0), (b, 0.5), (c, 2.5), (d, 0.25))   # push order, not the heap's
    s.cancel(b)
    assert [e for e, _ in s.keyed()] == [a, c, d]
    batch = s.take(10_000, 1, 0.0)     # d runs first
    assert ids(batch) == ["d"] and [e for e, _ in s.keyed()] == [a, c]
    batch = s.take(10_000, 10, 2.0)    # c's deadline passed; a runs
    assert batch.expired == [c] and ids(batch) == ["a"] and s.keyed() == ()
    s.push(Entry("e", 1, FAR, 3.0))
    s.drain()
    assert s.keyed() == ()


def test_waiting_since_is_the_arrival_that_found_the_queue_empty():
    s = Scheduler(10, age_rate=100.0)
    a, b, c = Entry("a", 10, FAR, 1.0), Entry("b", 10, FAR, 2.0), Entry("c", 10, FAR, 3.0)
    s.push(a)
    s.push(b)
    assert s.waiting_since == 1.0
    s.take(10_000, 1, 2.5)                # a runs, b still waits: since 1.0
    assert s.waiting_since == 1.0
    s.cancel(b)                           # empty again: the next arrival starts a new wait
    s.push(c)
    assert s.waiting_since == 3.0


def test_head_is_the_next_live_entry():
    s = Scheduler(4, age_rate=100.0)
    assert s.head() is None
    a, b = Entry("a", 300, FAR, 0.0), Entry("b", 50, FAR, 0.0)
    s.push(a)
    s.push(b)
    assert s.head() is b
    s.cancel(b)
    assert s.head() is a and len(s) == 1


def test_batch_ends_by_every_kept_promise():
    # rate 1000 tokens/s from t = 10: entries of 100 tokens end at 10.1, 10.2, 10.3, ... in one batch
    s = Scheduler(10)
    for i, by in enumerate([10.25, 20.0, 20.0, 20.0]):
        s.push(Entry(i, 100, FAR, 0.0, by))
    assert ids(s.take(10_000, 10, 10.0, 1000.0)) == [0, 1]     # a third would end at 10.3, past entry 0's 10.25
    assert ids(s.take(10_000, 10, 10.0, 1000.0)) == [2, 3]     # the rest promised 20.0: no cut
    # without a rate (inf) promises are not weighed
    for i in range(3):
        s.push(Entry(i, 100, FAR, 0.0, 10.0))
    assert ids(s.take(10_000, 10, 10.0)) == [0, 1, 2]


def test_promise_cut_keeps_the_head_and_ignores_the_late():
    s = Scheduler(10)
    # the head alone ends past its own promise (late anyway): it goes and does not cut the batch
    s.push(Entry("late", 500, FAR, 0.0, 10.1))
    s.push(Entry("a", 100, FAR, 0.0, 20.0))
    s.push(Entry("b", 100, FAR, 0.0, 20.0))
    assert ids(s.take(10_000, 10, 10.0, 1000.0)) == ["late", "a", "b"]
    # a later entry that would be late even joining now joins; one that can keep its promise cuts what follows
    s.push(Entry("head", 100, FAR, 0.0, 20.0))
    s.push(Entry("tight", 100, FAR, 0.0, 10.2))      # ends at 10.2 with the head: kept
    s.push(Entry("next", 100, FAR, 0.0, 20.0))       # would end at 10.3, past "tight"'s promise
    assert ids(s.take(10_000, 10, 10.0, 1000.0)) == ["head", "tight"]
    assert ids(s.take(10_000, 10, 10.0, 1000.0)) == ["next"]
    s.push(Entry("head", 100, FAR, 0.0, 20.0))
    s.push(Entry("hopeless", 100, FAR, 0.0, 10.15))  # 10.2 > 10.15: late wherever it runs, joins without a cut
    s.push(Entry("tail", 100, FAR, 0.0, 20.0))
    assert ids(s.take(10_000, 10, 10.0, 1000.0)) == ["head", "hopeless", "tail"]
