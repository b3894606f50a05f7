"""The numpy gated delta rule's carried state: a split sequence gives one whole call's outputs and state, and
both match a float64 token-by-token recurrence."""

from __future__ import annotations

import math

import numpy as np
import pytest

from clefcore.backends import cpu

HK, HV, DK, DV = 2, 4, 16, 12


def recurrence(q, k, v, g, beta, S0):
    """qwen35-backbone.md §3.6 step 7 in float64, one token at a time, from state S0 [Hv, dk, dv]."""
    r = v.shape[1] // k.shape[1]
    S = S0.astype(np.float64).copy()
    out = np.zeros(v.shape)
    for t in range(k.shape[0]):
        for j in range(v.shape[1]):
            kt, qt = k[t, j // r].astype(np.float64), q[t, j // r].astype(np.float64)
            S[j] *= math.exp(g[t, j])
            S[j] += np.outer(kt, beta[t, j] * (v[t, j] - S[j].T @ kt))
            out[t, j] = S[j].T @ qt
    return out, S


def inputs(T, seed):
    rng = np.random.default_rng(seed)
    q = cpu.l2norm(rng.standard_normal((T, HK, DK)).astype(np.float32), 1e-6, DK ** -0.5)
    k = cpu.l2norm(rng.standard_normal((T, HK, DK)).astype(np.float32), 1e-6)
    v = rng.standard_normal((T, HV, DV)).astype(np.float32)
    g, beta = cpu.gdn_gates(rng.standard_normal((T, HV)).astype(np.float32),
                            rng.standard_normal((T, HV)).astype(np.float32),
                            rng.uniform(-2, 0.5, HV).astype(np.float32), rng.standard_normal(HV).astype(np.float32))
    return q, k, v, g, beta


def initial_state(B, seed):
    return (np.random.default_rng(seed).standard_normal((B, HV, DK, DV)) * 0.5).astype(np.float32)


def close(got, want):
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * max(np.abs(want).max(initial=0.0), 1.0))


@pytest.mark.parametrize("T", [130, 200])
@pytest.mark.parametrize("split", [1, 37, 63, 64, 65, 129])
def test_split_with_carried_state_equals_whole(T, split):
    x = inputs(T, T + split)
    S0 = initial_state(1, split)
    whole_state = S0.copy()
    whole = cpu.gated_delta_rule(*x, np.array([0, T]), whole_state)
    st = S0.copy()
    first = cpu.gated_delta_rule(*(a[:split] for a in x), np.array([0, split]), st)
    second = cpu.gated_delta_rule(*(a[split:] for a in x), np.array([0, T - split]), st)
    close(np.concatenate([first, second]), whole)
    close(st, whole_state)
    want, S = recurrence(*x, S0[0])
    close(whole, want)
    close(whole_state[0], S)


def test_packed_batch_with_states():
    lengths = [65, 1, 0, 130, 63]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    x = inputs(int(cu[-1]), 7)
    S0 = initial_state(len(lengths), 8)
    st = S0.copy()
    got = cpu.gated_delta_rule(*x, cu, st)
    for b, (s0, s1) in enumerate(zip(cu[:-1], cu[1:])):
        want, S = recurrence(*(a[s0:s1] for a in x), S0[b])
        close(got[s0:s1], want)
        close(st[b], S)       # an empty sequence keeps its state
    # the same batch cut in two packed calls (every sequence split at a different point), state carried
    cut = [40, 1, 0, 64, 17]
    st2 = S0.copy()
    parts = []
    for lo, hi in ((np.zeros(5, int), cut), (cut, lengths)):
        sl = [slice(s0 + a, s0 + b) for s0, a, b in zip(cu[:-1], lo, hi)]
        cu_p = np.concatenate([[0], np.cumsum([s.stop - s.start for s in sl])])
        parts.append((sl, cpu.gated_delta_rule(*(np.concatenate([a[s] for s in sl]) for a in x), cu_p, st2)))
    out2 = np.empty_like(got)
    for sl, o in parts:
        out2[np.concatenate([np.arange(s.start, s.stop) for s in sl])] = o
    close(out2, got)
    close(st2, st)


def test_no_state_is_zero_state():
    x = inputs(70, 3)
    cu = np.array([0, 5, 70])
    z = np.zeros((2, HV, DK, DV), np.float32)
    np.testing.assert_array_equal(cpu.gated_delta_rule(*x, cu), cpu.gated_delta_rule(*x, cu, z))
    with pytest.raises(ValueError):
        cpu.gated_delta_rule(*x, cu, np.zeros((1, HV, DK, DV), np.float32))
