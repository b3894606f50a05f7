"""The Gated DeltaNet path of the CUDA backend: causal depthwise conv + SiLU (cuda/conv1d.cu), the gates, and the
chunked delta rule with carried state in the WY form (cuda/gated_delta_wy.cu; fast's operands:
cuda/gated_delta_wy_fast.cu)."""

from __future__ import annotations

import numpy as np

from ... import errors, kernel_select, precision
from ..cpu import GDN_CHUNK
from .device import DeviceContext
from .elementwise import NULL, gdn_gates_k

_CONV_KMAX, _CONV_TT = 8, 16   # conv1d.cu: CONV_KMAX taps at most, CONV_TT tokens per thread
_WY_OUT_COLS = 32               # gated_delta_wy.cu: OW, the output columns gdn_wy_out takes per piece


class DeltaRule:
    """The Gated DeltaNet ops on ``ctx``: the conv, the gates and the chunked delta rule, whose launches go in
    groups of at most ``block_chunks`` chunks."""

    def __init__(self, ctx: DeviceContext, block_chunks: int):
        self.ctx = ctx
        self.block_chunks = int(block_chunks)

    def conv1d_silu(self, x, w, cu_seqlens, prev=None):
        """See cpu.conv1d_silu: prev [K-1, C] = pre-conv rows before x[0], read by the first sequence only."""
        ctx = self.ctx
        cp = ctx.cp
        x, R, C, xs = ctx.rows(x)
        T = R
        K = w.shape[1]
        cu = np.asarray(ctx.to_host(cu_seqlens), dtype=np.int64)
        starts = np.repeat(cu[:-1], np.diff(cu)).astype(np.int32)
        y = cp.empty((T, C), dtype=cp.float32)
        if prev is not None:
            prev = ctx.contiguous(prev)
            if prev.shape != (K - 1, C):
                raise ValueError(f"conv prev must be [{K - 1}, {C}], got {prev.shape}")
        if K > _CONV_KMAX:
            raise errors.DeviceError(f"conv1d kernel size {K}: the CUDA kernel takes at most {_CONV_KMAX} taps")
        grid = (-(-C // 128), -(-T // _CONV_TT))
        ctx.kernel("conv1d.cu", "conv1d_silu_k")(grid, (128,), (x, np.int64(xs), ctx.contiguous(w),
                                                                ctx.upload(starts), NULL if prev is None else prev,
                                                                y, np.int32(T), np.int32(C), np.int32(K)))
        return y

    def gdn_gates(self, a, b, a_log, dt_bias):
        f32 = self.ctx.f32
        g, beta = gdn_gates_k()(f32(a), f32(b), f32(a_log), f32(dt_bias))
        return g, beta

    def gated_delta_rule(self, q, k, v, g, beta, cu_seqlens, state=None):
        """The WY-form kernels of the plan's row of the precision table (gdn_wy_prep, gdn_wy_scan, gdn_wy_out), per
        group of chunks. state: None or fp32 [B, hv, dk, dv], read at each sequence's start and overwritten in
        place with its final state."""
        ctx = self.ctx
        cp = ctx.cp
        T, hk, dk = k.shape
        hv, dv = v.shape[1], v.shape[2]
        C = GDN_CHUNK
        if dk % 16 or dv % 16 or dk > 128 or dv > 128:
            raise errors.DeviceError(f"gated delta rule with dk={dk}, dv={dv}: the kernels need multiples of 16 "
                                     "up to 128")
        cu = np.asarray(ctx.to_host(cu_seqlens), dtype=np.int64)
        nb = len(cu) - 1
        st = None
        if state is not None:
            if tuple(state.shape) != (nb, hv, dk, dv) or state.dtype != cp.float32:
                raise ValueError(f"state must be float32 [{nb}, {hv}, {dk}, {dv}], got {state.dtype} {state.shape}")
            st = state if state.flags.c_contiguous and state.data.ptr % 256 == 0 else cp.ascontiguousarray(state)
        q, k = ctx.contiguous(q), ctx.contiguous(k)
        g, beta = ctx.contiguous(g), ctx.contiguous(beta)
        # v may be a column slice of the conv output: [T, hv, dv] with a token stride
        v = ctx.f32(v)
        if not (v.strides[2] == 4 and v.strides[1] == dv * 4 and v.data.ptr % 4 == 0):
            v = cp.ascontiguousarray(v)
        vs = v.strides[0] // 4
        chunks, seq_of = [], []
        for b_, (s0, s1) in enumerate(zip(cu[:-1], cu[1:])):
            for c0 in range(int(s0), int(s1), C):
                chunks.append((c0, min(C, int(s1) - c0), 0, 0))
                seq_of.append(b_)
        out = cp.empty((T, hv, dv), dtype=cp.float32)
        if not chunks:
            return out
        if st is None:
            st = cp.empty((nb, hv, dk, dv), dtype=cp.float32)
        self._wy(self.kernels().module, q, k, v, vs, g, beta, np.array(chunks, dtype=np.int32),
                 np.array(seq_of), st, state is None, out)
        if state is not None and st is not state:
            state[...] = st
        return out

    def _wy(self, module, q, k, v, vs, g, beta, chunks_np, seq_of, st, fresh, out):
        """gdn_wy_prep, gdn_wy_scan, gdn_wy_out per group of chunks. chunks_np [n, 4] int32 (start, length, 0, 0),
        seq_of [n] the sequence of each chunk, st the fp32 states (read where a sequence starts unless ``fresh``,
        written at its end), out [T, hv, dv]."""
        ctx = self.ctx
        cp = ctx.cp
        T, hk, dk = k.shape
        hv, dv = out.shape[1], out.shape[2]
        C = GDN_CHUNK
        LK = dk + 8
        bv = self.scan_columns(hv, dv, len(np.unique(seq_of)))
        # the kernels' shared-memory layouts (cuda/gated_delta_wy.cu, each kernel's comment)
        prep_smem = max(4 * C * LK, 4 * C * (C + 4)) + 8192 + 1024
        scan_smem = 4 * C * LK + 4 * (dk + C) * (bv + 8) + 8192 + 4 * (C + 4)
        out_smem = 4 * C * LK + max(4 * C * LK, 4 * (dk + C) * (_WY_OUT_COLS + 8)) + 4 * C * (C + 8) + 8192 + 8 * C
        sfx = "_d128" if dk == dv == 128 else ""
        prep = ctx.kernel(module, "gdn_wy_prep" + sfx, prep_smem)
        scan = ctx.kernel(module, "gdn_wy_scan" + sfx, scan_smem)
        outk = ctx.kernel(module, "gdn_wy_out" + sfx, out_smem)
        # workspace per chunk: per value head gamma, U (then V') fp32, -W and the entering state as fp16 hi + lo;
        # per key head K hi + lo (144 KB per value head at 128 x 128, 16 key heads of 32)
        per = hv * (4 * C + 4 * C * dv + 4 * C * dk + 4 * dk * dv) + hk * 4 * C * dk
        ncap = self._group(len(chunks_np), per)
        Gw = cp.empty((ncap, hv, C), dtype=cp.float32)
        Uw = cp.empty((ncap, hv, C, dv), dtype=cp.float32)
        Ww = cp.empty((ncap, hv, 2, C, dk), dtype=cp.float16)
        Kw = cp.empty((ncap, hk, 2, C, dk), dtype=cp.float16)
        Hw = cp.empty((ncap, hv, 2, dk, dv), dtype=cp.float16)
        i32 = np.int32
        for c0 in range(0, len(chunks_np), ncap):
            c1 = min(c0 + ncap, len(chunks_np))
            ch = ctx.upload(chunks_np[c0:c1])
            prep((c1 - c0, hv), (256,), (k, v, np.int64(vs), g, beta, ch, i32(hk), i32(hv), i32(dk), i32(dv), Gw, Uw,
                                         Ww, Kw), shared_mem=prep_smem)
            seqs = self._seqs(seq_of, c0, c1, fresh)
            scan((hv, dv // bv, len(seqs)), (256,), (ctx.upload(seqs), i32(hk), i32(hv), i32(dk), i32(dv), i32(bv),
                                                     Gw, Uw, Ww, Kw, st, Hw), shared_mem=scan_smem)
            outk((c1 - c0, hv), (256,), (q, ch, i32(hk), i32(hv), i32(dk), i32(dv), Gw, Uw, Kw, Hw, out),
                 shared_mem=out_smem)

    def _group(self, n: int, per: int) -> int:
        """Chunks per launch group: block_chunks, and at most 256 MiB of workspace at ``per`` bytes a chunk
        (128 chunks at 32 heads of 128); groups of equal size (64 chunks: 32 + 32, not 36 + 28),
        so that the per-chunk grids end in fewer part-full waves."""
        ncap = max(1, min(self.block_chunks, n, (256 << 20) // per))
        return -(-n // -(-n // ncap))

    @staticmethod
    def _seqs(seq_of, c0: int, c1: int, fresh: bool) -> np.ndarray:
        """The scan's rows for the chunks [c0, c1): (first chunk, end chunk) within the group, whether the state
        starts at zero (``fresh`` and the sequence's first chunk is in the group), the state slot."""
        seqs = []
        for b_ in np.unique(seq_of[c0:c1]):
            idx = np.nonzero(seq_of[c0:c1] == b_)[0]
            first_global = c0 + idx[0]
            zero = fresh and (first_global == 0 or seq_of[first_global - 1] != b_)
            seqs.append((int(idx[0]), int(idx[-1]) + 1, int(zero), int(b_)))
        return np.array(seqs, dtype=np.int32)

    def kernels(self) -> precision.DeltaRule:
        """The delta rule's kernels this backend runs now (kernel_select.delta_rule)."""
        return kernel_select.delta_rule(self.ctx.setting)

    def scan_columns(self, hv, dv, nseq):
        """State columns per gdn_wy_scan block (one block per SM: its latency, not its work, sets the time):
        32, or 16 when twice the blocks still fit on the SMs."""
        return 32 if dv % 32 == 0 and 2 * hv * (dv // 32) * nseq > self.ctx.sm_count else 16
