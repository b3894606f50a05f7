"""The numpy ops against naive formulations (token recurrences, dense loops)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from clefcore.backends import cpu

from test_gdn_state import recurrence


def recurrent_delta_rule(q, k, v, g, beta):
    """The float64 token recurrence from a zero state."""
    return recurrence(q, k, v, g, beta, np.zeros((v.shape[1], k.shape[2], v.shape[2])))[0]


@pytest.mark.parametrize("lengths", [[1], [63], [65], [130, 7, 64]])
def test_chunked_delta_rule_equals_recurrence(lengths):
    rng = np.random.default_rng(sum(lengths))
    T, hk, hv, dk, dv = sum(lengths), 2, 4, 16, 12
    q = cpu.l2norm(rng.standard_normal((T, hk, dk)).astype(np.float32), 1e-6, dk ** -0.5)
    k = cpu.l2norm(rng.standard_normal((T, hk, dk)).astype(np.float32), 1e-6)
    v = rng.standard_normal((T, hv, dv)).astype(np.float32)
    g, beta = cpu.gdn_gates(rng.standard_normal((T, hv)).astype(np.float32) * 3,
                            rng.standard_normal((T, hv)).astype(np.float32),
                            rng.uniform(-1, 1.5, hv).astype(np.float32), rng.standard_normal(hv).astype(np.float32))
    cu = np.concatenate([[0], np.cumsum(lengths)])
    got = cpu.gated_delta_rule(q, k, v, g, beta, cu)
    for s0, s1 in zip(cu[:-1], cu[1:]):   # a boundary resets the state
        want = recurrent_delta_rule(q[s0:s1], k[s0:s1], v[s0:s1], g[s0:s1], beta[s0:s1])
        np.testing.assert_allclose(got[s0:s1], want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_strong_decay_does_not_overflow():
    """gamma reaches -1e4 inside a chunk: exp of positive differences must never be formed."""
    T, h, d = 64, 1, 8
    rng = np.random.default_rng(0)
    q = cpu.l2norm(rng.standard_normal((T, h, d)).astype(np.float32), 1e-6)
    k = cpu.l2norm(rng.standard_normal((T, h, d)).astype(np.float32), 1e-6)
    v = rng.standard_normal((T, h, d)).astype(np.float32)
    g = np.full((T, h), -200.0, np.float32)
    beta = np.full((T, h), 0.5, np.float32)
    with np.errstate(over="raise", invalid="raise"):
        out = cpu.gated_delta_rule(q, k, v, g, beta, np.array([0, T]))
    want = recurrent_delta_rule(q, k, v, g, beta)
    np.testing.assert_allclose(out, want, atol=1e-5)


@pytest.mark.parametrize("lengths", [[1], [65], [3, 70, 1]])
def test_attention_equals_dense_causal(lengths):
    rng = np.random.default_rng(len(lengths))
    T, hq, hkv, d = sum(lengths), 4, 2, 8
    q, k, v = (rng.standard_normal((T, h, d)).astype(np.float32) for h in (hq, hkv, hkv))
    cu = np.concatenate([[0], np.cumsum(lengths)])
    got = cpu.attention(q, k, v, cu, 0.3)
    for s0, s1 in zip(cu[:-1], cu[1:]):
        for t in range(s0, s1):
            for h in range(hq):
                sc = np.array([0.3 * q[t, h] @ k[u, h // 2] for u in range(s0, t + 1)], np.float64)
                p = np.exp(sc - sc.max())
                p /= p.sum()
                np.testing.assert_allclose(got[t, h], p @ v[s0:t + 1, h // 2], atol=1e-5)


def test_conv_is_causal_cross_correlation_per_sequence():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((10, 5)).astype(np.float32)
    w = rng.standard_normal((5, 4)).astype(np.float32)
    cu = np.array([0, 6, 10])
    got = cpu.conv1d_silu(x, w, cu)
    for s0, s1 in zip(cu[:-1], cu[1:]):
        for t in range(s0, s1):
            acc = sum(w[:, j] * x[t - 3 + j] for j in range(4) if t - 3 + j >= s0)
            np.testing.assert_allclose(got[t], acc / (1 + np.exp(-acc)), atol=1e-6)


def test_gelu_uses_erf():
    x = np.linspace(-9, 9, 2001).astype(np.float32)
    want = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x.astype(np.float64)])
    np.testing.assert_allclose(cpu.gelu(x), want, rtol=2e-7, atol=1e-7)


def test_rotary_pairs_i_with_i_plus_half():
    x = np.arange(16, dtype=np.float32).reshape(1, 1, 16)
    cos, sin = cpu.rope_tables(np.array([1]), 8, 10000.0)
    y = cpu.rotary(x, cos, sin)
    ang = 1.0 / (10000.0 ** (np.arange(0, 8, 2) / 8))
    np.testing.assert_allclose(y[0, 0, :4], x[0, 0, :4] * np.cos(ang) - x[0, 0, 4:8] * np.sin(ang), rtol=1e-6)
    np.testing.assert_allclose(y[0, 0, 4:8], x[0, 0, 4:8] * np.cos(ang) + x[0, 0, :4] * np.sin(ang), rtol=1e-6)
    np.testing.assert_array_equal(y[0, 0, 8:], x[0, 0, 8:])


def test_span_means_and_segment_softmax():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((20, 6)).astype(np.float32)
    np.testing.assert_allclose(cpu.span_means(x, [0, 3, 19], [1, 10, 20]),
                               [x[0:1].mean(0), x[3:10].mean(0), x[19:20].mean(0)], rtol=1e-6, atol=1e-6)
    scores = rng.standard_normal(5).astype(np.float32)
    owner = np.array([0, 0, 1, 1, 1])
    got = cpu.segment_softmax_sum(scores, x[:5], owner, 2)
    for q in range(2):
        e = np.exp(scores[owner == q] - scores[owner == q].max())
        np.testing.assert_allclose(got[q], (e / e.sum()) @ x[:5][owner == q], rtol=1e-5, atol=1e-6)
