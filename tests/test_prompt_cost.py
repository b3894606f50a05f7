"""The longest prompt a deployment takes (server/prompt_cost.py): a chunk's time growing with its offset, fitted
from one chunked run, and the limit it sets within the wait budget."""

from __future__ import annotations

import pytest

from clefcore.errors import PromptTokensError
from clefcore.server.prompt_cost import PromptCost, PromptLimit


def chunks(rate: float, pair: float, chunk: int, count: int, noise=()):
    """(offset, tokens, seconds) of ``count`` chunks whose time is their tokens over ``rate`` plus ``pair`` for
    each of their tokens times each token before them (and within them, causally), each times 1 + its noise."""
    out = []
    for i in range(count):
        offset = i * chunk
        seconds = chunk / rate + pair * chunk * (offset + chunk / 2)
        out.append((offset, chunk, seconds * (1 + (noise[i] if i < len(noise) else 0.0))))
    return out


def test_the_fit_finds_the_growth_of_a_chunk_with_its_offset():
    samples = chunks(9_000.0, 5e-8, 1_391, 4)[1:]
    cost = PromptCost.fit(samples, 9_000.0)
    assert cost.per_token_pair == pytest.approx(5e-8) and cost.rate == 9_000.0
    # the whole run of those chunks is what the model says, up to the within-chunk half pair
    assert sum(s for _, _, s in chunks(9_000.0, 5e-8, 1_391, 4)) == pytest.approx(cost.seconds(4 * 1_391), rel=1e-9)


def test_noise_that_turns_the_growth_negative_counts_none():
    samples = chunks(9_000.0, 0.0, 1_024, 4, noise=(0.0, 0.3, 0.1, 0.0))[1:]
    assert PromptCost.fit(samples, 9_000.0).per_token_pair == 0.0
    with pytest.raises(ValueError):
        PromptCost.fit(samples[:1], 9_000.0)
    with pytest.raises(ValueError):
        PromptCost.fit([(0, 10, 0.1), (0, 10, 0.2)], 9_000.0)


@pytest.mark.parametrize("pair", [0.0, 1e-9, 5e-8, 1e-6])
def test_longest_is_the_last_length_within_the_seconds(pair):
    cost = PromptCost(9_000.0, pair)
    for seconds in (0.01, 1.0, 15.0):
        tokens = cost.longest(seconds)
        assert cost.seconds(tokens) <= seconds < cost.seconds(tokens + 1)


def test_the_limit_is_the_context_where_the_device_runs_it_within_the_budget():
    fast = PromptCost(30_000.0, 1e-11)                  # a GPU: 24,576 tokens in under a second
    assert PromptLimit.sized(None, fast, 15.0, 24_576).tokens == 24_576
    slow = PromptCost(9_000.0, 5e-8)                    # a CPU: 24,576 tokens in 17.8 s
    assert slow.seconds(24_576) > 15.0
    limit = PromptLimit.sized(None, slow, 15.0, 24_576)
    assert limit.tokens == slow.longest(15.0) < 24_576
    assert PromptLimit.sized(30_000, slow, 15.0, 24_576).tokens == 24_576      # configured, within the context
    assert PromptLimit.sized(1_000, slow, 15.0, 24_576).tokens == 1_000


def test_a_prompt_over_the_limit_is_refused_naming_it():
    limit = PromptLimit.sized(None, PromptCost(9_000.0, 5e-8), 15.0, 24_576)
    limit.check(limit.tokens)
    with pytest.raises(PromptTokensError) as refused:
        limit.check(limit.tokens + 1)
    error = refused.value
    assert error.field == "state" and error.limit == f"{limit.tokens} tokens"
    assert f"prompt is {limit.tokens + 1} tokens" in error.message and "--max-prompt-tokens" in error.message
