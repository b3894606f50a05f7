"""The full-attention path of the CUDA backend: rotary, the K/V cache, causal GQA attention and the vision tower's
bidirectional attention (cuda/attention.cu, cuda/rotary.cu; on Hopper the causal attention of
cuda/attention_wgmma.cu, as clefcore/kernel_select.py chooses), with their host-side work list."""

from __future__ import annotations

import numpy as np

from ... import errors, kernel_select
from ...kernel_select import ATTN, AttnKernels, Products
from ..cpu import vision_query_rows
from ..cpu import rope_tables as _rope_tables_host
from .device import DeviceContext
from .elementwise import ELEM_THREADS, sigmoid_gate_k
from .matmul import Matmul

# head dims with a kernel in attention.cu: attn_fwd_d{D} (causal), attn_bidir_d{D} (bidirectional)
CAUSAL_DIMS = (16, 32, 64, 128, 256)
BIDIR_DIMS = (16, 32, 64, 72, 128, 256)


def attention_tiles(cu, t0: int, t1: int, rows: int, causal: bool = True) -> np.ndarray:
    """attention.cu's work list for query rows [t0, t1) of a packed stream (sequence starts ``cu``): int32 rows
    (seq_start, seq_end, q0, q1), one per ``rows`` queries of a sequence. seq_end is clipped to t1: K/V cache rows
    past the block are not written yet for this layer. Longest key range first: the kernel's grid runs heads
    fastest over this order, so the longest blocks of every head start in the first wave. A causal block's keys
    end at its last query (q1 - seq_start), a bidirectional one's at its sequence's end (seq_end - seq_start)."""
    tiles = []
    for s0, s1 in zip(cu[:-1], cu[1:]):
        a, e = max(int(s0), t0), min(int(s1), t1)
        for q0 in range(a, e, rows):
            tiles.append((int(s0), e, q0, min(q0 + rows, e)))
    tiles.sort(key=(lambda t: t[0] - t[3]) if causal else (lambda t: t[0] - t[1]))
    return np.array(tiles, dtype=np.int32).reshape(-1, 4)


def check_bidirectional(D, Dv):
    """Refuses head dims without a bidirectional kernel in attention.cu."""
    if D not in BIDIR_DIMS or Dv != D:
        raise errors.DeviceError(f"bidirectional attention head dim {D} (value dim {Dv}) has no CUDA kernel "
                                 f"(head dims with one: {', '.join(map(str, BIDIR_DIMS))})")


class Attention:
    """Rotary, the K/V cache, the output gate, and attention: causal over a packed stream (``attention``),
    bidirectional within each sequence (``run_kernel`` with ``causal=False`` on the fp16 kernel, or
    ``bidirectional_fp32``). ``matmul`` gives the fp32 batched products and the GEMM operands' dtype."""

    def __init__(self, ctx: DeviceContext, matmul: Matmul):
        self.ctx = ctx
        self.matmul = matmul

    def sigmoid_gate(self, o, gate, gemm_input=False):
        """See cpu.sigmoid_gate; for a GEMM's activation (``gemm_input``: the o-projection's, rows o's leading
        axis), in the dtype Matmul.operand_dtype names."""
        ctx = self.ctx
        half = gemm_input and o.ndim > 1 and self.matmul.operand_dtype(o.shape[0]) == ctx.cp.float16
        return sigmoid_gate_k(half)(ctx.f32(o), ctx.f32(gate))

    def rope_tables(self, positions, rotary_dim, theta):
        c, s = _rope_tables_host(np.asarray(self.ctx.to_host(positions)), rotary_dim, theta)
        return self.ctx.to_device(c), self.ctx.to_device(s)

    def rotary(self, x, cos, sin):
        ctx = self.ctx
        T, H, D = x.shape
        xr, R, _, rs = ctx.rows(x)
        half = cos.shape[1]
        y = ctx.cp.empty((T, H, D), dtype=ctx.cp.float32)
        ctx.kernel("rotary.cu", "rotary_rows")(ctx.grid1(y.size), (ELEM_THREADS,),
                                               (xr, np.int64(rs), ctx.contiguous(cos), ctx.contiguous(sin), y,
                                                np.int32(T), np.int32(H), np.int32(D), np.int32(half)))
        return y

    def kv_cache(self, T, heads, D):
        """K (or V) rows of a whole packed stream for token-blocked attention, fp16 (what the kernel reads)."""
        return self.ctx.cp.empty((T, heads, D), dtype=self.ctx.cp.float16)

    def kv_write(self, cache, t0, x):
        """cache[t0:t0 + n] = x [n, heads, D], rounded to the cache's fp16 in one pass. x may be a strided view
        (v is a column slice of the fused q|k|v projection): CuPy's casting copy walks its strides."""
        self.ctx.cp.copyto(cache[t0:t0 + x.shape[0]], self.ctx.f32(x), casting="same_kind")

    def attention(self, q, k, v, cu_seqlens, scale, q_offset=0):
        """q [n, Hq, D] = query rows [q_offset, q_offset + n) of the packed stream; k/v [>= q_offset + n, Hkv, D]
        (fp16 cache or fp32) hold its rows from 0; cu_seqlens describes the whole stream (see cpu.attention)."""
        n, hq, D = q.shape
        if D not in CAUSAL_DIMS or v.shape[2] != D:
            raise errors.DeviceError(f"attention head dim {D} (value dim {v.shape[2]}) has no CUDA kernel")
        t0 = int(q_offset)
        t1 = t0 + n
        kernels = kernel_select.causal_attention(self.ctx.setting, D,
                                                 k.dtype == np.float16 and v.dtype == np.float16)
        return self.run_kernel(q, k[:t1], v[:t1], cu_seqlens, scale, t0, causal=True, kernels=kernels)

    def bidirectional_attention(self, q, k, v, cu_seqlens, scale):
        """See cpu.bidirectional_attention: every query row of a packed sequence (one image's patches) sees all of
        that sequence's keys. q, k, v [N, heads, D], fp32 or fp16, any strides (v is usually a column slice of the
        fused q|k|v projection)."""
        check_bidirectional(q.shape[2], v.shape[2])
        if not q.shape == k.shape == v.shape:
            raise errors.DeviceError(f"bidirectional attention needs one shape for q, k and v: q {tuple(q.shape)}, "
                                     f"k {tuple(k.shape)}, v {tuple(v.shape)}")
        if kernel_select.bidirectional_attention(self.ctx.setting) is not Products.FP16_KERNEL:
            return self.bidirectional_fp32(q, k, v, cu_seqlens, scale)
        return self.run_kernel(q, k, v, cu_seqlens, scale, 0, causal=False)

    def bidirectional_fp32(self, q, k, v, cu_seqlens, scale):
        """The vision attention of the paths without ``attention_fp16`` (the exact ones; kernel_select's
        FP32_CUBLAS): fp32 products, as
        cpu.bidirectional_attention. The fp16 kernel's roundings of q, k, v and the probabilities (~2e-4 of the
        tower's output on the golden images) reach the backbone through every image token and grew there to
        2.3e-3 per layer on the H200 (text: 2.8e-4); the tower's attention is a small part of an image request,
        so exact pays for fp32 here."""
        ctx = self.ctx
        cp = ctx.cp
        bmm = self.matmul.bmm
        q, k, v = ctx.f32(q), ctx.f32(k), ctx.f32(v)
        out = cp.empty(q.shape, dtype=cp.float32)
        heads = q.shape[1]
        cu = np.asarray(ctx.to_host(cu_seqlens), dtype=np.int64)
        for s0, s1 in zip(cu[:-1].tolist(), cu[1:].tolist()):
            if s0 == s1:
                continue
            kk = k[s0:s1].transpose(1, 2, 0)                      # [H, D, L]
            vv = v[s0:s1].transpose(1, 0, 2)                      # [H, L, D]
            rows = vision_query_rows(heads, s1 - s0)
            for b0 in range(s0, s1, rows):
                b1 = min(b0 + rows, s1)
                sc = bmm(q[b0:b1].transpose(1, 0, 2), kk) * np.float32(scale)
                sc = cp.exp(sc - sc.max(axis=-1, keepdims=True))
                out[b0:b1] = bmm(sc / sc.sum(axis=-1, keepdims=True), vv).transpose(1, 0, 2)
        return out

    def run_kernel(self, q, k, v, cu_seqlens, scale, t0, causal, kernels=ATTN):
        """``kernels``' {prefix}_fwd_d{D} (causal) or {prefix}_bidir_d{D} over query rows [t0, t0 + n) of the packed
        stream (k/v: its rows from 0 on) -> fp32 [n, Hq, D]; q/k/v are converted to the fp16 the kernel reads
        where they are not already."""
        ctx = self.ctx
        cp = ctx.cp
        n, hq, D = q.shape
        hkv = k.shape[1]
        cu = np.asarray(ctx.to_host(cu_seqlens), dtype=np.int64)
        smem, warps = self._launch_shape(kernels, D)
        tiles = attention_tiles(cu, t0, t0 + n, 16 * warps, causal)
        out = cp.empty((n, hq, D), dtype=cp.float32)
        if not len(tiles):
            return out
        tl = ctx.upload(tiles)
        q16, k16, v16 = ctx.half(q), ctx.half(k), ctx.half(v)
        fn = ctx.kernel(kernels.file, kernels.name("fwd" if causal else "bidir", D), smem)
        for i in range(0, len(tiles), 65535):     # gridDim.y's limit (65,535 one-token sequences in one block)
            fn((hq, min(65535, len(tiles) - i)), (32 * warps,), (q16, k16, v16, out, tl[i:], np.int32(hq),
                                                                 np.int32(hkv), np.float32(scale), np.int32(t0)),
               shared_mem=smem)
        return out

    def _launch_shape(self, kernels: AttnKernels, D):
        """(shared-memory bytes, warps per block) of ``kernels``' head-dim-D kernels as compiled for this device
        (attention.cu chooses both per architecture): asked once from the file's {prefix}_launch_d{D}."""
        ctx = self.ctx
        key = (kernels.file, D)
        got = ctx.caches.attn_launch.get(key)
        if got is None:
            n = ctx.cp.zeros(2, dtype=ctx.cp.int32)
            ctx.kernel(kernels.file, kernels.name("launch", D))((1,), (1,), (n,))
            got = ctx.caches.attn_launch[key] = tuple(int(v) for v in n.get())
        return got
