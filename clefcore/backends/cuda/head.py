"""The joint schema head's ops on the GPU: GELU, grouped multi-head attention over the head's few rows (fp32),
span means, normalisation and the per-question softmax (``Head``).

model/head.py replays the head as a CUDA graph (``CudaOps.head_graphs``), so two ops take kernels a capture
accepts: the attention's fp32 products call cuBLAS through clefcore's ctypes entry (``Matmul.bmm``, cublas.py;
CuPy's own binding refuses a capture) with CuPy's matmul's very arguments, and the per-question softmax sum runs
one kernel that adds each question's options in row order (a scatter with atomics adds them in whatever order the
GPU schedules them: for three options and more, rounding that moves from run to run, and answers that would not be
the same bits twice)."""

from __future__ import annotations

import math

import numpy as np

from ..cpu import check_groups, group_keys
from .device import DeviceContext
from .elementwise import gelu_k, segment_softmax_sum_k
from .matmul import Matmul


class Head:
    """The joint head's ops on ``ctx``; ``matmul`` gives the projections and the attention's batched products."""

    def __init__(self, ctx: DeviceContext, matmul: Matmul):
        self.ctx = ctx
        self.matmul = matmul

    def gelu(self, x):
        return gelu_k()(self.ctx.f32(x))

    def mha(self, xq, xkv, in_w, in_b, out_w, out_b, heads, groups=None, group_ids=None):
        """See cpu.mha. With groups the scores are masked per query block, each block against the key range of
        its groups only, in blocks that keep the score matrix under 64 MiB. The mask reads ``group_ids`` (the
        same ids on the device) where given, else ``groups`` uploaded; ``group_ids`` alone: the same blocks, each
        against every key, so that no launch depends on the ids (the joint head's graphs replay it)."""
        ctx, mm = self.ctx, self.matmul
        cp = ctx.cp
        check_groups(groups)
        W = xq.shape[-1]
        d = W // heads
        # one GEMM per distinct input: [q | k | v] for self-attention, [k | v] of the memory for cross-attention
        # (wider products fill more of the GPU; the head's GEMMs are small)
        if xkv is xq:
            qkv = mm.linear(xq, in_w, in_b)
            q, kv = qkv[:, :W], qkv[:, W:]
        else:
            q, kv = mm.linear(xq, in_w[:W], in_b[:W]), mm.linear(xkv, in_w[W:], in_b[W:])
        q = q.reshape(-1, heads, d).transpose(1, 0, 2)
        k = kv[:, :W].reshape(-1, heads, d).transpose(1, 2, 0)
        v = kv[:, W:].reshape(-1, heads, d).transpose(1, 0, 2)
        n, m = q.shape[1], v.shape[1]
        o = cp.empty((heads, n, d), dtype=cp.float32)
        masked = groups is not None or group_ids is not None
        rows = max(1, (16 << 20) // max(1, heads * m)) if masked else n
        if group_ids is not None:
            gq, gk = group_ids
        elif groups is not None:
            gq, gk = ctx.upload(np.asarray(groups[0], np.int32)), ctx.upload(np.asarray(groups[1], np.int32))
        for b0 in range(0, n, rows):
            b1 = min(b0 + rows, n)
            k0, k1 = group_keys(groups, b0, b1, m)
            sc = mm.bmm(q[:, b0:b1], k[:, :, k0:k1]) * np.float32(1.0 / math.sqrt(d))   # fp32, head only
            if masked:
                sc = cp.where(gq[b0:b1, None] == gk[None, k0:k1], sc, np.float32(-np.inf))
            sc = cp.exp(sc - sc.max(axis=-1, keepdims=True))
            o[:, b0:b1] = mm.bmm(sc / sc.sum(axis=-1, keepdims=True), v[:, k0:k1])
        return mm.linear(o.transpose(1, 0, 2).reshape(-1, W), out_w, out_b)

    def span_means(self, x, starts, ends):
        """See cpu.span_means; ``starts``/``ends`` on the host or the device, never read back."""
        ctx = self.ctx
        cp = ctx.cp
        x = ctx.f32(x)
        c = cp.zeros((x.shape[0] + 1, x.shape[1]), dtype=cp.float64)
        cp.cumsum(x, axis=0, dtype=cp.float64, out=c[1:])
        s, e = ctx.asarray(starts), ctx.asarray(ends)
        n = (e - s).astype(cp.float64)[:, None]          # span lengths: integers, exact in float64
        return ((c[e] - c[s]) / n).astype(cp.float32)

    def normalize(self, x, eps):
        cp = self.ctx.cp
        x = self.ctx.f32(x)
        return x / cp.maximum(cp.sqrt(cp.sum(x * x, axis=-1, keepdims=True)), np.float32(eps))

    def segment_softmax_sum(self, scores, values, owner, n_groups):
        """See cpu.segment_softmax_sum; ``owner`` non-decreasing (a question's options are adjacent rows)."""
        ctx = self.ctx
        cp = ctx.cp
        scores = ctx.f32(scores)
        values = ctx.f32(values)
        own = ctx.asarray(owner)
        out = cp.empty((n_groups, values.shape[1]), dtype=cp.float32)
        return segment_softmax_sum_k()(ctx.contiguous(scores), ctx.contiguous(values).reshape(-1),
                                       own.astype(cp.int64, copy=False), np.int64(scores.shape[0]),
                                       np.int64(values.shape[1]), out)
