"""The error model of a one-pass delta rule in the folded form (S' = S + N + M' S, O = O' + Q' S), the form the
GPU ran before the WY form replaced it: in numpy, rounding each tensor-core product's two operands to fp16 once,
and nowhere else (the solve, the state and every sum stay fp32). Kept for gdn_wy_precision.py, which measures the
WY form's candidates against it: the folded one-pass rule took fast's worst golden error from 6.4e-3 to 9.0e-3
on the H100 (docs/bench/2026-12-06-h100-fast-delta-rule-margin/).

Why the recurrence dominates the state's error: M' = (gamma - 1) I - Kd^T W is close to -I where the chunk decays
strongly, so S + M' S cancels S almost entirely, and the fp16 rounding of S inside M' S (2^-11 of S) survives
the cancellation against a small result."""

from __future__ import annotations

import numpy as np

C = 64   # GDN_CHUNK


def _h(x):
    return x.astype(np.float16).astype(np.float32)


def _mm(a, b):
    return _h(a) @ _h(b)


def gated_delta_rule(q, k, v, g, beta, cu_seqlens, state=None):
    """As clefcore.backends.cpu.gated_delta_rule (same arguments, state updated in place), with the fast
    kernels' fp16 operand roundings."""
    T, hk, dk = k.shape
    hv, dv = v.shape[1], v.shape[2]
    r = hv // hk
    out = np.empty((T, hv, dv), np.float32)
    ti = np.tril(np.ones((C, C), bool))
    ts = np.tril(np.ones((C, C), bool), -1)
    eye = np.eye(dk, dtype=np.float32)
    for b, (s0, s1) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        L = int(s1 - s0)
        if L == 0:
            continue
        n = -(-L // C)
        pad = n * C - L

        def chunks(a, heads):
            a = np.concatenate([a, np.zeros((pad,) + a.shape[1:], np.float32)])
            return a.reshape(n, C, heads, -1).transpose(2, 0, 1, 3)

        Q = np.repeat(chunks(q[s0:s1], hk), r, axis=0)
        K = np.repeat(chunks(k[s0:s1], hk), r, axis=0)
        V = chunks(v[s0:s1], hv)
        B = chunks(beta[s0:s1, :, None], hv)[..., 0]
        G = np.cumsum(chunks(g[s0:s1, :, None], hv)[..., 0], axis=-1)
        D = np.exp(np.where(ti, G[..., :, None] - G[..., None, :], -np.inf))
        A = np.where(ts, B[..., :, None] * _mm(K, K.transpose(0, 1, 3, 2)) * D, 0.0)
        rhs = np.concatenate([B[..., None] * V, (B * np.exp(G))[..., None] * K], axis=-1)
        sol = np.linalg.solve(np.eye(C) + A, rhs).astype(np.float32)
        Un, W = sol[..., :dv], sol[..., dv:]
        QKD = _mm(Q, K.transpose(0, 1, 3, 2)) * D
        Kd = K * np.exp(G[..., -1:] - G)[..., None]
        KdT = Kd.transpose(0, 1, 3, 2)
        N = _mm(KdT, Un)
        M = (np.exp(G[..., -1]) - 1)[..., None, None] * eye - _mm(KdT, W)
        Qp = Q * np.exp(G)[..., None] - _mm(QKD, W)
        Op = _mm(QKD, Un)
        S = np.zeros((hv, dk, dv), np.float32) if state is None else state[b].astype(np.float32)
        O = np.empty((hv, n, C, dv), np.float32)
        for c in range(n):
            O[:, c] = Op[:, c] + _mm(Qp[:, c], S)
            S = S + N[:, c] + _mm(M[:, c], S)
        out[s0:s1] = O.transpose(1, 2, 0, 3).reshape(n * C, hv, dv)[:L]
        if state is not None:
            state[b] = S
    return out
