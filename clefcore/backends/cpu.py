"""The fp32 numpy backend: the engine's ground truth and every CUDA kernel's reference.

``CpuOps`` (at the end) is the ``Backend`` (clefcore/backends/interface.py), with the same member names and
parameters as ``CudaOps``. Each of its op methods runs this module's function of the same name: pure numpy, no
state, so the kernels' tests call the functions directly as references (with the helpers beyond the interface:
``silu``, ``gelu_tanh``, ``bidirectional_attention``...). Activations are ``[tokens, ...]`` row-major; several
sequences may be packed into one token stream, described by ``cu_seqlens`` (int array of sequence starts plus
the total, like ``[0, 300, 512]``).
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np

from ..checkpoint import TensorRef, to_float32
from ..errors import GuardError
from ..precision import FP32, Plan

ATTN_QUERY_BLOCK = 256   # query rows per block: bounds the score matrix, never L x L
GDN_CHUNK = 64


def gather_rows(table, ids):
    return table[np.asarray(ids)].astype(np.float32)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def silu(x):
    return x * sigmoid(x)


# ---------------------------------------------------------------------------------------------- backbone ops

def embed(table, ids):
    return table[ids].astype(np.float32)


def rmsnorm(x, w, eps, gemm_input=False):
    """Zero-centred RMSNorm over the last axis: x / rms(x) * (1 + w). ``gemm_input`` (the result only feeds weight
    GEMMs, so a GPU may write their operand) changes nothing here: numpy's one form is fp32; also below."""
    x = x.astype(np.float32, copy=False)
    inv = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))
    return x * inv * (1.0 + w)


def add_rmsnorm(x, delta, w, eps, gemm_input=False):
    """Residual add fused with the next norm: returns (x + delta, rmsnorm(x + delta))."""
    s = x + delta
    return s, rmsnorm(s, w, eps)


def linear(x, w, b=None):
    y = x @ w.T
    return y if b is None else y + b


def mlp(x, w_gate, w_up, w_down):
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    return (silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


def sigmoid_gate(o, gate, gemm_input=False):
    """Attention output times sigmoid(gate), both [T, heads, D]."""
    return o * sigmoid(gate)


def rope_tables(positions, rotary_dim, theta):
    """cos/sin [T, rotary_dim/2] in fp32, as transformers builds them (inv_freq in fp32). positions [T], or
    [T, rotary_dim/2] with a position per frequency (M-RoPE: rope in model/backbone.py picks each frequency's
    axis)."""
    inv = 1.0 / (np.float32(theta) ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)))
    pos = positions.astype(np.float32)
    ang = (pos[:, None] if pos.ndim == 1 else pos) * inv.astype(np.float32)[None, :]
    return np.cos(ang), np.sin(ang)


def rotary(x, cos, sin):
    """Half-split (NeoX) rotation of the first 2*cos.shape[1] dims of each head; x is [T, heads, D]."""
    half = cos.shape[1]
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    out = x.copy()
    out[..., :half] = x1 * c - x2 * s
    out[..., half:2 * half] = x2 * c + x1 * s
    return out


def kv_cache(T, heads, D):
    """The K (or V) rows of a whole packed stream for blocked attention: fp32 here (fp16 on the GPU)."""
    return np.empty((T, heads, D), np.float32)


def kv_write(cache, t0, x):
    """Store rows x [n, heads, D] at cache[t0:t0 + n]."""
    cache[t0:t0 + x.shape[0]] = x


def attention(q, k, v, cu_seqlens, scale, q_offset=0):
    """Causal GQA softmax attention inside each packed sequence. q [n,Hq,D], k/v [>= q_offset+n,Hkv,D] ->
    [n,Hq,D]. q holds the query rows [q_offset, q_offset + n) of the packed stream that cu_seqlens describes;
    k/v hold (at least) its rows [0, q_offset + n): query t sees the keys [start of its sequence, t]."""
    n, hq, d = q.shape
    t0, t1 = int(q_offset), int(q_offset) + n
    group = hq // k.shape[1]
    out = np.empty((n, hq, v.shape[2]), dtype=np.float32)
    for s0, s1 in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        a, e = max(int(s0), t0), min(int(s1), t1)
        if a >= e:
            continue
        kk = np.repeat(k[s0:e], group, axis=1).transpose(1, 2, 0)    # [Hq, D, L]
        vv = np.repeat(v[s0:e], group, axis=1).transpose(1, 0, 2)    # [Hq, L, Dv]
        for b0 in range(a, e, ATTN_QUERY_BLOCK):
            b1 = min(b0 + ATTN_QUERY_BLOCK, e)
            qq = q[b0 - t0:b1 - t0].transpose(1, 0, 2)                 # [Hq, m, D]
            keys = b1 - s0                                              # later keys are all masked
            sc = (qq @ kk[:, :, :keys]) * np.float32(scale)
            rows = np.arange(b0 - s0, b1 - s0)[:, None]
            sc = np.where(np.arange(keys)[None, :] <= rows, sc, -np.inf)
            sc = np.exp(sc - sc.max(axis=-1, keepdims=True))
            p = sc / sc.sum(axis=-1, keepdims=True)
            out[b0 - t0:b1 - t0] = (p @ vv[:, :keys]).transpose(1, 0, 2)
    return out


def conv1d_silu(x, w, cu_seqlens, prev=None):
    """Causal depthwise conv (cross-correlation, tap K-1 = current token) + SiLU. x [T,C], w [C,K].
    ``prev`` [K-1, C] (optional): the pre-conv rows just before x[0] in x[0]'s sequence (a block of a longer
    stream); they feed the first sequence of cu_seqlens only. Without it every sequence starts from zeros."""
    K = w.shape[1]
    out = np.empty_like(x, dtype=np.float32)
    for i, (s0, s1) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        head = prev if (i == 0 and prev is not None) else np.zeros((K - 1, x.shape[1]), np.float32)
        xs = np.concatenate([head, x[s0:s1]])
        acc = np.zeros((s1 - s0, x.shape[1]), np.float32)
        for j in range(K):
            acc += xs[j:j + s1 - s0] * w[:, j]
        out[s0:s1] = silu(acc)
    return out


def l2norm(x, eps, scale=1.0):
    """x / sqrt(sum(x^2) + eps) * scale over the last axis (eps inside the sqrt of the sum)."""
    return x * (np.float32(scale) / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(eps)))


def gdn_gates(a, b, a_log, dt_bias):
    """beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias) (log-decay, <= 0). a, b [T, Hv]."""
    z = a + dt_bias
    softplus = np.where(z > 20.0, z, np.log1p(np.exp(np.minimum(z, 20.0))))
    return -np.exp(a_log) * softplus, sigmoid(b)


def gated_delta_rule(q, k, v, g, beta, cu_seqlens, state=None):
    """Chunked (WY/UT) gated delta rule with an fp32 state, per packed sequence.

    q, k [T, Hk, dk] (already L2-normalised; q also scaled), v [T, Hv, dv], g, beta [T, Hv].
    Value head j reads key head j // (Hv/Hk). Returns o [T, Hv, dv].
    state: None (every sequence starts from S = 0) or an fp32 array [B, Hv, dk, dv], B = len(cu_seqlens) - 1:
    sequence b starts from state[b], and state[b] is overwritten in place with the state after its last token
    (o_t = q_t S; an empty sequence leaves its state as it was). Splitting a sequence anywhere and carrying
    the state gives the same outputs as one call.
    """
    T, hk, dk = k.shape
    hv, dv = v.shape[1], v.shape[2]
    r = hv // hk
    C = GDN_CHUNK
    if state is not None and (state.shape != (len(cu_seqlens) - 1, hv, dk, dv) or state.dtype != np.float32):
        raise ValueError(f"state must be float32 [{len(cu_seqlens) - 1}, {hv}, {dk}, {dv}], "
                         f"got {state.dtype} {state.shape}")
    out = np.empty((T, hv, dv), np.float32)
    tri_incl = np.tril(np.ones((C, C), bool))
    tri_strict = np.tril(np.ones((C, C), bool), -1)
    for b, (s0, s1) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        L = s1 - s0
        if L == 0:
            continue
        n = -(-L // C)
        pad = n * C - L

        def chunks(a, heads):  # [L, heads, d] -> [heads, n, C, d], zero-padded tail
            a = np.concatenate([a, np.zeros((pad,) + a.shape[1:], np.float32)])
            return a.reshape(n, C, heads, -1).transpose(2, 0, 1, 3)

        Q = np.repeat(chunks(q[s0:s1], hk), r, axis=0)
        K = np.repeat(chunks(k[s0:s1], hk), r, axis=0)
        V = chunks(v[s0:s1], hv)
        B = chunks(beta[s0:s1, :, None], hv)[..., 0]      # [Hv, n, C]
        G = np.cumsum(chunks(g[s0:s1, :, None], hv)[..., 0], axis=-1)   # gamma, cumulative log-decay
        diff = G[..., :, None] - G[..., None, :]
        D = np.exp(np.where(tri_incl, diff, -np.inf))      # mask before exp: never exponentiate > 0
        KK = K @ K.transpose(0, 1, 3, 2)
        A = np.where(tri_strict, B[..., :, None] * KK * D, 0.0)
        eye = np.eye(C, dtype=np.float32)
        rhs = np.concatenate([B[..., None] * V, (B * np.exp(G))[..., None] * K], axis=-1)
        sol = np.linalg.solve(eye + A, rhs).astype(np.float32)   # (I + A)^-1 [beta V | beta Gamma K]
        Unew, W = sol[..., :dv], sol[..., dv:]
        QK = (Q @ K.transpose(0, 1, 3, 2)) * D
        Qg = Q * np.exp(G)[..., None]
        Kd = K * np.exp(G[..., -1:] - G)[..., None]
        S = np.zeros((hv, dk, dv), np.float32) if state is None else state[b].astype(np.float32)
        O = np.empty((hv, n, C, dv), np.float32)
        for c in range(n):        # the only sequential part: one step per 64-token chunk
            U = Unew[:, c] - W[:, c] @ S
            O[:, c] = Qg[:, c] @ S + QK[:, c] @ U
            S = np.exp(G[:, c, -1])[:, None, None] * S + Kd[:, c].transpose(0, 2, 1) @ U
        out[s0:s1] = O.transpose(1, 2, 0, 3).reshape(n * C, hv, dv)[:L]
        if state is not None:
            state[b] = S
    return out


def gated_rmsnorm(x, z, w, eps, gemm_input=False):
    """Per-head RMSNorm with a plain weight, times SiLU(z). x, z [..., d] (e.g. [tokens, heads, d])."""
    inv = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))
    return (x * inv) * w * silu(z)


# -------------------------------------------------------------------------------------------------- head ops

def layernorm(x, w, b, eps=1e-5):
    mu = x.mean(axis=-1, keepdims=True)
    c = x - mu
    var = (c * c).mean(axis=-1, keepdims=True)
    return c / np.sqrt(var + np.float32(eps)) * w + b


def _erf(x):
    """erf in float64: Maclaurin series for |x| <= 2.5, continued fraction for erfc beyond."""
    x = np.asarray(x, dtype=np.float64)
    a = np.abs(x)
    small = np.minimum(a, 2.5)
    term = small.copy()
    total = small.copy()
    x2 = small * small
    for n in range(1, 60):
        term = term * (-x2) / n
        total += term / (2 * n + 1)
    series = total * (2.0 / np.sqrt(np.pi))
    big = np.maximum(a, 2.5)
    frac = np.zeros_like(big)
    for n in range(60, 0, -1):  # erfc(z) = exp(-z^2)/sqrt(pi) / (z + (1/2)/(z + 1/(z + (3/2)/(z + ...))))
        frac = (n / 2.0) / (big + frac)
    cf = 1.0 - np.exp(-big * big) / np.sqrt(np.pi) / (big + frac)
    return np.sign(x) * np.where(a <= 2.5, series, cf)


def gelu(x):
    """Exact (erf) GELU."""
    return (0.5 * x * (1.0 + _erf(x / np.sqrt(2.0)))).astype(np.float32)


def mha(xq, xkv, in_w, in_b, out_w, out_b, heads, groups=None, group_ids=None):
    """torch.nn.MultiheadAttention forward. ``groups`` = (gq, gk), non-decreasing group ids of the query and the
    key rows (the packed sequences of the joint head): a query attends only to the keys of its own group
    (None: to every key). The blocks' key ranges are planned on ``groups``; the mask reads ``group_ids``, the same
    ids as the caller holds them (the joint head's index table), where given; ``group_ids`` alone: the mask over
    every key (see Backend.mha)."""
    W = xq.shape[-1]
    d = W // heads
    q = (xq @ in_w[:W].T + in_b[:W]).reshape(-1, heads, d).transpose(1, 0, 2)
    k = (xkv @ in_w[W:2 * W].T + in_b[W:2 * W]).reshape(-1, heads, d).transpose(1, 2, 0)
    v = (xkv @ in_w[2 * W:].T + in_b[2 * W:]).reshape(-1, heads, d).transpose(1, 0, 2)
    check_groups(groups)
    mask = groups if group_ids is None else group_ids
    n = q.shape[1]
    o = np.empty((heads, n, d), np.float32)
    for b0 in range(0, n, ATTN_QUERY_BLOCK):
        b1 = min(b0 + ATTN_QUERY_BLOCK, n)
        k0, k1 = group_keys(groups, b0, b1, v.shape[1])
        sc = (q[:, b0:b1] @ k[:, :, k0:k1]) * np.float32(1.0 / np.sqrt(d))
        if mask is not None:
            gq, gk = mask
            sc = np.where(gq[b0:b1, None] == gk[None, k0:k1], sc, np.float32(-np.inf))
        sc = np.exp(sc - sc.max(axis=-1, keepdims=True))
        o[:, b0:b1] = (sc / sc.sum(axis=-1, keepdims=True)) @ v[:, k0:k1]
    return o.transpose(1, 0, 2).reshape(-1, W) @ out_w.T + out_b


def group_keys(groups, b0: int, b1: int, n_keys: int) -> tuple[int, int]:
    """The key rows [k0, k1) that query rows [b0, b1) may attend to under mha's ``groups`` (both id lists are
    sorted, so a query block's groups own one contiguous key range)."""
    if groups is None:
        return 0, n_keys
    gq, gk = groups
    return int(np.searchsorted(gk, gq[b0], "left")), int(np.searchsorted(gk, gq[b1 - 1], "right"))


def check_groups(groups) -> None:
    """A query group without keys would softmax over nothing (NaN): refuse it by name."""
    if groups is not None:
        missing = np.setdiff1d(np.asarray(groups[0]), np.asarray(groups[1]))
        if missing.size:
            raise ValueError(f"mha groups: query groups {missing[:8].tolist()} have no keys")


def span_means(x, starts, ends):
    """Mean of x[s:e] for each half-open span, from a float64 prefix sum. x [L, D] -> [n, D]."""
    c = np.zeros((x.shape[0] + 1, x.shape[1]), np.float64)
    np.cumsum(x, axis=0, out=c[1:])
    starts, ends = np.asarray(starts), np.asarray(ends)
    return ((c[ends] - c[starts]) / (ends - starts)[:, None]).astype(np.float32)


def normalize(x, eps):
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), np.float32(eps))


def segment_softmax_sum(scores, values, owner, n_groups):
    """For each group q: softmax of scores over the rows it owns, then the weighted sum of their values."""
    m = np.full(n_groups, -np.inf, np.float32)
    np.maximum.at(m, owner, scores)
    e = np.exp(scores - m[owner])
    den = np.zeros(n_groups, np.float32)
    np.add.at(den, owner, e)
    out = np.zeros((n_groups, values.shape[1]), np.float32)
    np.add.at(out, owner, (e / den[owner])[:, None] * values)
    return out


# ------------------------------------------------------------------------------------------------ vision ops

VISION_SCORES = 1 << 25      # 128 MiB of fp32 scores per block of the vision attention


def gelu_tanh(x):
    """GELU with the tanh approximation (transformers' gelu_pytorch_tanh), in fp32: the vision blocks' MLP."""
    x = x.astype(np.float32, copy=False)
    k = np.float32(np.sqrt(2.0 / np.pi))
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(k * (x + np.float32(0.044715) * x * x * x)))


def patch_rows(images):
    """The vision tower's input: resized uint8 images [16 gh, 16 gw, 3] -> their normalised patch rows, concatenated
    [sum gh gw, 1536] fp32 (preprocess.patch_values per image)."""
    from ..preprocess import patch_values
    return np.concatenate([patch_values(img) for img in images]) if images else np.empty((0, 1536), np.float32)


def vision_attention(x, qkv_w, qkv_b, proj_w, proj_b, heads, cos, sin, cu_seqlens):
    """The attention half of a vision block on its normed input x [N, W]: the fused q|k|v projection, the 2-D RoPE
    of q and k (cos/sin [N, D/2]), bidirectional attention within each image (cu_seqlens), the out-projection."""
    n, W = x.shape
    D = W // heads
    qkv = linear(x, qkv_w, qkv_b).reshape(n, 3, heads, D)
    q, k = rotary(qkv[:, 0], cos, sin), rotary(qkv[:, 1], cos, sin)
    o = bidirectional_attention(q, k, qkv[:, 2], cu_seqlens, 1.0 / np.sqrt(D))
    return linear(o.reshape(n, W), proj_w, proj_b)


def vision_mlp(x, w1, b1, w2, b2):
    """The MLP half of a vision block on its normed input: fc2(gelu_tanh(fc1(x)))."""
    return linear(gelu_tanh(linear(x, w1, b1)), w2, b2)


def vision_query_rows(heads: int, keys: int) -> int:
    """Query rows per block of the vision attention: the [heads, rows, keys] scores stay within VISION_SCORES
    floats even for a 16 MP image."""
    return max(1, min(ATTN_QUERY_BLOCK, VISION_SCORES // (heads * keys)))


def bidirectional_attention(q, k, v, cu_seqlens, scale):
    """Softmax attention without a causal mask inside each packed sequence (one image's patches attend to every
    patch of that image and no other). q, k, v [N, heads, D] -> [N, heads, D]."""
    out = np.empty(q.shape[:2] + (v.shape[2],), dtype=np.float32)
    for s0, s1 in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        s0, s1 = int(s0), int(s1)
        if s0 == s1:
            continue
        kk = k[s0:s1].transpose(1, 2, 0)                               # [H, D, L]
        vv = v[s0:s1].transpose(1, 0, 2)                               # [H, L, D]
        rows = vision_query_rows(q.shape[1], s1 - s0)
        for b0 in range(s0, s1, rows):
            b1 = min(b0 + rows, s1)
            sc = (q[b0:b1].transpose(1, 0, 2) @ kk) * np.float32(scale)
            sc = np.exp(sc - sc.max(axis=-1, keepdims=True))
            out[b0:b1] = ((sc / sc.sum(axis=-1, keepdims=True)) @ vv).transpose(1, 0, 2)
    return out


# ------------------------------------------------------------------------------------------------ the backend

class CpuOps:
    """The numpy ``Backend``: an object holding what a caller may set on a backend (plan, token block,
    graphs), whose op methods run the functions above of the same name (a subclass overrides one to emulate a
    kernel's rounding); the rest is the interface's plumbing, which numpy mostly does not need (no device
    memory, no deferred guards, no faster path to fall back from)."""

    name = "cpu"
    xp = np
    mode = FP32
    falls_back = False       # fp32 throughout: there is no faster path to fall back from

    plan: Plan
    token_block: int
    graphs: None
    tower_graphs: None
    head_graphs: None

    def __init__(self):
        self.plan = Plan(FP32)
        # model/backbone.py's token block (layer-outer, block-inner; see its doc): 0 = the whole stream at once.
        # The GPU's knob is CudaOps(token_block=...); results do not depend on it beyond fp rounding.
        self.token_block = 0
        self.graphs = None       # nothing to replay: numpy has no launch overhead to save
        self.tower_graphs = None
        self.head_graphs = None

    # ------------------------------------------------------------------------------ forward and guards
    def fallback(self):
        """The range-safe path: numpy's fp32 is that path already (falls_back is False)."""
        return nullcontext()

    def reserve(self, worst_case) -> int:
        """Nothing to reserve: numpy allocates from the host's memory as it goes."""
        return 0

    def begin_forward(self) -> None:
        """The CUDA backend routes allocations to its arena here; numpy needs nothing."""

    def end_forward(self) -> None:
        pass

    def watch(self, x, what: str) -> None:
        """Raise GuardError at once when x holds NaN/Inf or is entirely zero (a silently dead kernel): on the CPU
        there is nothing to defer."""
        x = np.asarray(x)
        bad = int(x.size - np.count_nonzero(np.isfinite(x)))
        if bad:
            raise GuardError(f"{what}: {bad} of {x.size} values are NaN or Inf", what)
        if x.size and not np.any(x):
            raise GuardError(f"{what}: all {x.size} values are zero", what)

    def check_watched(self) -> None:
        pass

    def memory_in_use(self) -> int:
        """No device memory: the server's device-memory gauge reads 0."""
        return 0

    def status(self) -> dict:
        """Nothing beyond the mode for /health: no GEMM library to miss."""
        return {}

    def fp16_summary(self) -> None:
        """Weights stay fp32 here: nothing was saturated or flushed (the CUDA backend reports its conversion)."""
        return None

    # ---------------------------------------------------------------------------------- data movement
    def asarray(self, x) -> np.ndarray:
        return np.asarray(x)

    def to_host(self, x) -> np.ndarray:
        return np.asarray(x)

    def weight(self, w) -> np.ndarray:
        """How a checkpoint tensor (TensorRef, or an fp32 host array) is stored for this backend: fp32."""
        if isinstance(w, TensorRef):
            return to_float32(w)
        return np.ascontiguousarray(w, dtype=np.float32)

    def table(self, ref) -> np.ndarray:
        """Vocabulary tables (embedding, LM head): widened to fp32 like every other weight on the CPU."""
        return to_float32(ref)

    def gather_rows(self, table, ids):
        return gather_rows(table, ids)

    def embed(self, table, ids):
        return embed(table, ids)

    # ----------------------------------------------------------------------------------------- backbone
    def rmsnorm(self, x, w, eps, gemm_input=False):
        return rmsnorm(x, w, eps, gemm_input)

    def add_rmsnorm(self, x, delta, w, eps, gemm_input=False):
        return add_rmsnorm(x, delta, w, eps, gemm_input)

    def linear(self, x, w, b=None):
        return linear(x, w, b)

    def mlp(self, x, w_gate, w_up, w_down):
        return mlp(x, w_gate, w_up, w_down)

    def rope_tables(self, positions, rotary_dim, theta):
        return rope_tables(positions, rotary_dim, theta)

    def rotary(self, x, cos, sin):
        return rotary(x, cos, sin)

    def kv_cache(self, T, heads, D):
        return kv_cache(T, heads, D)

    def kv_write(self, cache, t0, x):
        return kv_write(cache, t0, x)

    def attention(self, q, k, v, cu_seqlens, scale, q_offset=0):
        return attention(q, k, v, cu_seqlens, scale, q_offset)

    def sigmoid_gate(self, o, gate, gemm_input=False):
        return sigmoid_gate(o, gate, gemm_input)

    def conv1d_silu(self, x, w, cu_seqlens, prev=None):
        return conv1d_silu(x, w, cu_seqlens, prev)

    def l2norm(self, x, eps, scale=1.0):
        return l2norm(x, eps, scale)

    def gdn_gates(self, a, b, a_log, dt_bias):
        return gdn_gates(a, b, a_log, dt_bias)

    def gated_delta_rule(self, q, k, v, g, beta, cu_seqlens, state=None):
        return gated_delta_rule(q, k, v, g, beta, cu_seqlens, state)

    def gated_rmsnorm(self, x, z, w, eps, gemm_input=False):
        return gated_rmsnorm(x, z, w, eps, gemm_input)

    # --------------------------------------------------------------------------------------------- head
    def layernorm(self, x, w, b, eps=1e-5):
        return layernorm(x, w, b, eps)

    def gelu(self, x):
        return gelu(x)

    def sigmoid(self, x):
        return sigmoid(x)

    def mha(self, xq, xkv, in_w, in_b, out_w, out_b, heads, groups=None, group_ids=None):
        return mha(xq, xkv, in_w, in_b, out_w, out_b, heads, groups, group_ids)

    def span_means(self, x, starts, ends):
        return span_means(x, starts, ends)

    def normalize(self, x, eps):
        return normalize(x, eps)

    def segment_softmax_sum(self, scores, values, owner, n_groups):
        return segment_softmax_sum(scores, values, owner, n_groups)

    # ------------------------------------------------------------------------------------- vision tower
    def patch_rows(self, images):
        return patch_rows(images)

    def vision_attention(self, x, qkv_w, qkv_b, proj_w, proj_b, heads, cos, sin, cu_seqlens):
        return vision_attention(x, qkv_w, qkv_b, proj_w, proj_b, heads, cos, sin, cu_seqlens)

    def vision_mlp(self, x, w1, b1, w2, b2):
        return vision_mlp(x, w1, b1, w2, b2)
