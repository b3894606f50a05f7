"""The vision tower's ops on the GPU (cuda/vision.cu, with attention.cu's bidirectional kernels and the GEMMs):
its input rows from the uint8 images, the attention and MLP halves of a block, each with its memory-bound steps
fused (bias, 2-D RoPE and the fp16 rounding of q/k/v in one pass; bias, tanh GELU and the next GEMM's fp16 operand
in one)."""

from __future__ import annotations

import math

import numpy as np

from ... import kernel_select
from ...kernel_select import Products
from ...preprocess import PATCH, patch_grid
from .attention import Attention, check_bidirectional
from .device import DeviceContext
from .elementwise import ELEM_THREADS, NULL
from .matmul import Matmul

ROW = 3 * 2 * PATCH * PATCH      # one patch row: channels x temporal slots x 16 x 16


class Vision:
    """The vision tower's ops on ``ctx``; ``matmul`` gives the GEMMs, ``attn`` the bidirectional attention."""

    def __init__(self, ctx: DeviceContext, matmul: Matmul, attn: Attention):
        self.ctx = ctx
        self.matmul = matmul
        self.attn = attn

    def patch_rows(self, images):
        """See cpu.patch_rows: each uint8 image goes up as it is (3 bytes a pixel) and becomes its rows here."""
        ctx = self.ctx
        cp = ctx.cp
        grids = [patch_grid(np.shape(img)) for img in images]
        out = cp.empty((sum(gh * gw for gh, gw in grids), ROW), dtype=cp.float32)
        r0 = 0
        for img, (gh, gw) in zip(images, grids):
            dev = ctx.to_device(np.ascontiguousarray(img, dtype=np.uint8))
            ctx.kernel("vision.cu", "patch_rows")(ctx.grid1(gh * gw * ROW // 2), (ELEM_THREADS,),
                                                  (dev, np.int32(gh), np.int32(gw), out[r0:]))
            r0 += gh * gw
        return out

    def bias_gelu(self, x, b, y):
        """y = gelu_tanh(x + b) over x [.., N] fp32 (b [N] or None) into y: fp16 or fp32, x's shape."""
        ctx = self.ctx
        half = y.dtype == ctx.cp.float16
        rows = x.size // max(x.shape[-1], 1)
        ctx.kernel("vision.cu", "bias_gelu_tanh")(
            _rows_grid(rows), (ELEM_THREADS,),
            (x, NULL if b is None else ctx.contiguous(b), y if half else NULL, NULL if half else y, np.int64(rows),
             np.int32(x.shape[-1])))

    def _project(self, x, w, out):
        """out = x @ w^T without a bias (the fused kernel after it adds it): a GEMM route for fp16 matrices, the
        small-matrix reduction (linear) for fp32 ones."""
        if w.dtype == self.ctx.cp.float16:
            return self.matmul.gemm(x, w, out)
        out[...] = self.matmul.linear(x, w)
        return out

    def vision_attention(self, x, qkv_w, qkv_b, proj_w, proj_b, heads, cos, sin, cu_seqlens):
        """See cpu.vision_attention. The projection's bias and the RoPE are one pass (vision.cu qkv_rope_*) that
        writes what the attention reads: fp16 q/k/v for attention.cu's kernel (the plan's row: fast), fp32 for the
        exact modes' fp32 attention."""
        ctx = self.ctx
        cp = ctx.cp
        x = ctx.contiguous(x)
        n, W = x.shape
        D = W // heads
        check_bidirectional(D, D)
        qkv = self._project(x, qkv_w, cp.empty((n, 3 * W), dtype=cp.float32))
        fast = kernel_select.bidirectional_attention(ctx.setting) is Products.FP16_KERNEL
        q, k, v = cp.empty((3, n, heads, D), dtype=cp.float16 if fast else cp.float32)
        ctx.kernel("vision.cu", "qkv_rope_half" if fast else "qkv_rope_f32")(
            _rows_grid(n), (ELEM_THREADS,),
            (qkv, ctx.contiguous(qkv_b), ctx.contiguous(cos), ctx.contiguous(sin), q, k, v, np.int32(n),
             np.int32(heads), np.int32(D)))
        del qkv
        o = self.attn.bidirectional_attention(q, k, v, cu_seqlens, 1.0 / math.sqrt(D))
        del q, k, v
        return self.matmul.linear(o.reshape(n, W), proj_w, proj_b)

    def vision_mlp(self, x, w1, b1, w2, b2):
        """See cpu.vision_mlp. fc1's bias and the tanh GELU are one pass that writes fc2's operand: fp16 (fast, the
        rounding fc2's GEMM would make: the plan's row rounds GEMM operands once) or fp32 (the exact modes split
        it)."""
        ctx = self.ctx
        cp = ctx.cp
        x = ctx.contiguous(x)
        h = self._project(x, w1, cp.empty((x.shape[0], w1.shape[0]), dtype=cp.float32))
        fast = ctx.plan.row.gemm.fp16 and w2.dtype == cp.float16
        g = cp.empty(h.shape, dtype=cp.float16 if fast else cp.float32)
        self.bias_gelu(h, b1, g)
        del h
        if w2.dtype != cp.float16:
            return self.matmul.linear(g, w2, b2)
        return self.matmul.gemm(g, w2, cp.empty((g.shape[0], w2.shape[0]), dtype=cp.float32), ctx.contiguous(b2))


def _rows_grid(rows):
    """vision.cu's block-per-row kernels: a block per row up to gridDim.x's limit (they loop past it)."""
    return (int(min(max(rows, 1), 2 ** 31 - 1)),)
