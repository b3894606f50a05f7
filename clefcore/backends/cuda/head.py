"""The joint schema head's ops on the GPU: GELU, grouped multi-head attention over the head's few rows (fp32),
span means, normalisation and the per-question softmax. A mixin of ``CudaOps``.

model/head.py replays the head as a CUDA graph (``CudaOps.head_graphs``), so two ops take kernels a capture accepts:
the attention's fp32 products call cuBLAS through clefcore's ctypes entry (cublas.py; CuPy's own binding refuses a
capture) with CuPy's matmul's very arguments, and the per-question softmax sum runs one kernel that adds each
question's options in row order (a scatter with atomics adds them in whatever order the GPU schedules them: for
three options and more, rounding that moves from run to run, and answers that would not be the same bits twice)."""

from __future__ import annotations

import math

import numpy as np

from ... import kernel_select
from ...kernel_select import Products
from ..cpu import check_groups, group_keys
from . import cublas
from .elementwise import gelu_k, rowdot_k, segment_softmax_sum_k


class HeadOps:
    def gelu(self, x):
        return gelu_k()(self._f32(x))

    def mha(self, xq, xkv, in_w, in_b, out_w, out_b, heads, groups=None, group_ids=None):
        """See cpu.mha. With groups the scores are masked per query block, each block against the key range of
        its groups only, in blocks that keep the score matrix under 64 MiB. The mask reads ``group_ids`` (the
        same ids on the device) where given, else ``groups`` uploaded; ``group_ids`` alone: the same blocks, each
        against every key, so that no launch depends on the ids (the joint head's graphs replay it)."""
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
        masked = groups is not None or group_ids is not None
        rows = max(1, (16 << 20) // max(1, heads * m)) if masked else n
        if group_ids is not None:
            gq, gk = group_ids
        elif groups is not None:
            gq, gk = self._upload(np.asarray(groups[0], np.int32)), self._upload(np.asarray(groups[1], np.int32))
        for b0 in range(0, n, rows):
            b1 = min(b0 + rows, n)
            k0, k1 = group_keys(groups, b0, b1, m)
            sc = self._bmm(q[:, b0:b1], k[:, :, k0:k1]) * np.float32(1.0 / math.sqrt(d))   # fp32, head only
            if masked:
                sc = cp.where(gq[b0:b1, None] == gk[None, k0:k1], sc, np.float32(-np.inf))
            sc = cp.exp(sc - sc.max(axis=-1, keepdims=True))
            o[:, b0:b1] = self._bmm(sc / sc.sum(axis=-1, keepdims=True), v[:, k0:k1])
        return self.linear(o.transpose(1, 0, 2).reshape(-1, W), out_w, out_b)

    def _bmm(self, a, b):
        """fp32 batched a [h, n, k] @ b [h, k, m] (the head's attention scores and mix): CuPy's matmul's cuBLAS
        call made through ctypes, or where cuBLAS cannot be loaded a reduction over broadcast views (nothing
        [h, n, m, k] is materialised): kernel_select.head_products."""
        cp = self.cp
        if kernel_select.head_products(self.setting) is Products.FP32_REDUCTION:
            return rowdot_k()(a[:, :, None, :], b.transpose(0, 2, 1)[:, None, :, :], axis=3)
        # what CuPy's matmul does with these operands: C-contiguous copies where they are views, a fresh output
        a, b = cp.ascontiguousarray(a, dtype=cp.float32), cp.ascontiguousarray(b, dtype=cp.float32)
        h, n, k = a.shape
        out = cp.empty((h, n, b.shape[2]), dtype=cp.float32)
        cublas.gemm_batched_f32(self.device.cublas_handle, a.data.ptr, b.data.ptr, out.data.ptr, h, n, k,
                                b.shape[2], cp.cuda.get_current_stream().ptr)
        return out

    def span_means(self, x, starts, ends):
        """See cpu.span_means; ``starts``/``ends`` on the host or the device, never read back."""
        cp = self.cp
        x = self._f32(x)
        c = cp.zeros((x.shape[0] + 1, x.shape[1]), dtype=cp.float64)
        cp.cumsum(x, axis=0, dtype=cp.float64, out=c[1:])
        s, e = self.asarray(starts), self.asarray(ends)
        n = (e - s).astype(cp.float64)[:, None]          # span lengths: integers, exact in float64
        return ((c[e] - c[s]) / n).astype(cp.float32)

    def normalize(self, x, eps):
        cp = self.cp
        x = self._f32(x)
        return x / cp.maximum(cp.sqrt(cp.sum(x * x, axis=-1, keepdims=True)), np.float32(eps))

    def segment_softmax_sum(self, scores, values, owner, n_groups):
        """See cpu.segment_softmax_sum; ``owner`` non-decreasing (a question's options are adjacent rows)."""
        cp = self.cp
        scores = self._f32(scores)
        values = self._f32(values)
        own = self.asarray(owner)
        out = cp.empty((n_groups, values.shape[1]), dtype=cp.float32)
        return segment_softmax_sum_k()(self._c(scores), self._c(values).reshape(-1), own.astype(cp.int64, copy=False),
                                       np.int64(scores.shape[0]), np.int64(values.shape[1]), out)
