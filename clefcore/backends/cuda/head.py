"""The joint schema head's ops on the GPU: GELU, grouped multi-head attention over the head's few rows (fp32),
span means, normalisation and the per-question softmax. A mixin of ``CudaOps``."""

from __future__ import annotations

import math

import numpy as np

from ..cpu import check_groups, group_keys
from .elementwise import gelu_k, rowdot_k


class HeadOps:
    def gelu(self, x):
        return gelu_k()(self._f32(x))

    def mha(self, xq, xkv, in_w, in_b, out_w, out_b, heads, groups=None):
        """See cpu.mha. With groups the scores are masked per query block, each block against the key range of
        its groups only, in blocks that keep the score matrix under 64 MiB."""
        cp = self.cp
        check_groups(groups)
        W = xq.shape[-1]
        d = W // heads
        # one GEMM per distinct input: [q | k | v] for self-attention, [k | v] of the memory for cross-attention
        # (wider products fill more of the GPU; the head's GEMMs are small)
        if xkv is xq:
            qkv = self.linear(xq, in_w, in_b)
            q, kv = qkv[:, :W], qkv[:, W:]
        else:
            q, kv = self.linear(xq, in_w[:W], in_b[:W]), self.linear(xkv, in_w[W:], in_b[W:])
        q = q.reshape(-1, heads, d).transpose(1, 0, 2)
        k = kv[:, :W].reshape(-1, heads, d).transpose(1, 2, 0)
        v = kv[:, W:].reshape(-1, heads, d).transpose(1, 0, 2)
        n, m = q.shape[1], v.shape[1]
        o = cp.empty((heads, n, d), dtype=cp.float32)
        rows = n if groups is None else max(1, (16 << 20) // max(1, heads * m))
        if groups is not None:
            gq, gk = self._upload(np.asarray(groups[0], np.int32)), self._upload(np.asarray(groups[1], np.int32))
        for b0 in range(0, n, rows):
            b1 = min(b0 + rows, n)
            k0, k1 = group_keys(groups, b0, b1, m)
            sc = self._bmm(q[:, b0:b1], k[:, :, k0:k1]) * np.float32(1.0 / math.sqrt(d))   # fp32, head only
            if groups is not None:
                sc = cp.where(gq[b0:b1, None] == gk[None, k0:k1], sc, np.float32(-np.inf))
            sc = cp.exp(sc - sc.max(axis=-1, keepdims=True))
            o[:, b0:b1] = self._bmm(sc / sc.sum(axis=-1, keepdims=True), v[:, k0:k1])
        return self.linear(o.transpose(1, 0, 2).reshape(-1, W), out_w, out_b)

    def _bmm(self, a, b):
        """fp32 batched a [h, n, k] @ b [h, k, m] (the head's attention scores and mix): CuPy's matmul (cuBLAS), or
        where cuBLAS cannot be loaded a reduction over broadcast views (nothing [h, n, m, k] is materialised)."""
        if self.cublas_missing is None:
            return self.cp.matmul(a, b)
        return rowdot_k()(a[:, :, None, :], b.transpose(0, 2, 1)[:, None, :, :], axis=3)

    def span_means(self, x, starts, ends):
        cp = self.cp
        x = self._f32(x)
        c = cp.zeros((x.shape[0] + 1, x.shape[1]), dtype=cp.float64)
        cp.cumsum(x, axis=0, dtype=cp.float64, out=c[1:])
        s = np.asarray(self.to_host(starts), dtype=np.int64)
        e = np.asarray(self.to_host(ends), dtype=np.int64)
        n = self._to_device((e - s).astype(np.float64))[:, None]
        return ((c[self._to_device(e)] - c[self._to_device(s)]) / n).astype(cp.float32)

    def normalize(self, x, eps):
        cp = self.cp
        x = self._f32(x)
        return x / cp.maximum(cp.sqrt(cp.sum(x * x, axis=-1, keepdims=True)), np.float32(eps))

    def segment_softmax_sum(self, scores, values, owner, n_groups):
        cp = self.cp
        scores = self._f32(scores)
        values = self._f32(values)
        own = self.asarray(owner)
        m = cp.full(n_groups, -np.inf, dtype=cp.float32)
        cp.maximum.at(m, own, scores)
        e = cp.exp(scores - m[own])
        den = cp.zeros(n_groups, dtype=cp.float32)
        cp.add.at(den, own, e)
        out = cp.zeros((n_groups, values.shape[1]), dtype=cp.float32)
        cp.add.at(out, own, (e / den[own])[:, None] * values)
        return out
