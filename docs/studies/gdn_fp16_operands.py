"""Issue 30, item 1, before any kernel: how far a single-pass fp16 tensor-core delta rule (every product's two
operands rounded to fp16 once, fp32 accumulation, the triangular solve and the state in fp32) lands from the
fp32 chunked reference (clefcore.backends.cpu.gated_delta_rule), at clef-flash's head shapes (16 key heads, 32
value heads, 128 x 128), on random inputs of the model's kind: q and k L2-normalised (q also scaled), beta a
sigmoid, g a non-positive log-decay. Run with clefcore installed: python docs/studies/gdn_fp16_operands.py [T]

The emulation follows the reference's order of operations (not the kernel's folded form), so it bounds the kind
of error, not the kernel's exact figure. Its fp32 run must match the reference exactly (the first column)."""
import sys

import numpy as np

from clefcore.backends import cpu


def h(x):
    return x.astype(np.float16).astype(np.float32)


def gdn(q, k, v, g, beta, rnd):
    T, hk, dk = k.shape
    hv, dv = v.shape[1:]
    r = hv // hk
    C = 64
    n = -(-T // C)
    pad = n * C - T

    def chunks(a, heads):
        a = np.concatenate([a, np.zeros((pad,) + a.shape[1:], np.float32)])
        return a.reshape(n, C, heads, -1).transpose(2, 0, 1, 3)
    Q = np.repeat(chunks(q, hk), r, axis=0)
    K = np.repeat(chunks(k, hk), r, axis=0)
    V = chunks(v, hv)
    B = chunks(beta[:, :, None], hv)[..., 0]
    G = np.cumsum(chunks(g[:, :, None], hv)[..., 0], axis=-1)
    tri_incl = np.tril(np.ones((C, C), bool))
    tri_strict = np.tril(np.ones((C, C), bool), -1)
    D = np.exp(np.where(tri_incl, G[..., :, None] - G[..., None, :], -np.inf))
    mm = (lambda a, b: rnd(a) @ rnd(b))
    KK = mm(K, K.transpose(0, 1, 3, 2))
    A = np.where(tri_strict, B[..., :, None] * KK * D, 0.0)
    rhs = np.concatenate([B[..., None] * V, (B * np.exp(G))[..., None] * K], axis=-1)
    sol = np.linalg.solve(np.eye(C, dtype=np.float32) + A, rhs).astype(np.float32)
    Unew, W = sol[..., :dv], sol[..., dv:]
    QK = mm(Q, K.transpose(0, 1, 3, 2)) * D
    Qg = Q * np.exp(G)[..., None]
    Kd = K * np.exp(G[..., -1:] - G)[..., None]
    S = np.zeros((hv, dk, dv), np.float32)
    O = np.empty((hv, n, C, dv), np.float32)
    for c in range(n):
        U = Unew[:, c] - mm(W[:, c], S)
        O[:, c] = mm(Qg[:, c], S) + mm(QK[:, c], U)
        S = np.exp(G[:, c, -1])[:, None, None] * S + mm(Kd[:, c].transpose(0, 2, 1), U)
    return O.transpose(1, 2, 0, 3).reshape(n * C, hv, dv)[:T]


rng = np.random.default_rng(0)
T, hk, hv, d = int(sys.argv[1]) if len(sys.argv) > 1 else 1024, 16, 32, 128
def l2(x): return x / np.linalg.norm(x, axis=-1, keepdims=True)


for decay in (0.02, 0.3):
    q = (l2(rng.standard_normal((T, hk, d))) / np.sqrt(d)).astype(np.float32)
    k = l2(rng.standard_normal((T, hk, d))).astype(np.float32)
    v = rng.standard_normal((T, hv, d)).astype(np.float32)
    g = (-decay * rng.exponential(1.0, (T, hv))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((T, hv))))).astype(np.float32)
    ref = cpu.gated_delta_rule(q, k, v, g, beta, np.array([0, T]))
    same = gdn(q, k, v, g, beta, lambda x: x)
    fast = gdn(q, k, v, g, beta, h)
    scale = np.abs(ref).max()
    print(f"T={T} decay~{decay}: emulation (fp32) vs reference {np.abs(same - ref).max() / scale:.2e}; "
          f"fp16 operands vs reference {np.abs(fast - ref).max() / scale:.2e} (max), "
          f"{np.sqrt(np.mean((fast - ref) ** 2)) / np.sqrt(np.mean(ref ** 2)):.2e} (rms); "
          f"fp16 rounding of the output alone {np.abs(h(ref) - ref).max() / scale:.2e}")
