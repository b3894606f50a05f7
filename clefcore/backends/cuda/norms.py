"""RMSNorm (plain, fused with the residual add, gated), LayerNorm and L2 norm on the GPU (cuda/norms.cu). The
RMSNorms asked for a GEMM's activation (``gemm_input``) write it in the dtype ``Matmul.operand_dtype`` names: fp16
under the fused_elementwise switch (the ``*_h`` kernels: the same fp32 value, rounded once where the GEMM would
have rounded it)."""

from __future__ import annotations

import numpy as np

from .device import DeviceContext
from .matmul import Matmul


def map_args(rs, heads, hs):
    """norms.cu's row map arguments (xs, xh, xhs) for DeviceContext.row_map's (rs, heads, hs)."""
    return np.int64(rs), np.int32(heads), np.int64(hs)


class Norms:
    def __init__(self, ctx: DeviceContext, matmul: Matmul):
        self.ctx = ctx
        self.matmul = matmul

    @staticmethod
    def _row_launch(R, D):
        """norms.cu launch for R rows of D: (grid, block, G threads per row). A block per row from 1024 values
        on (a warp per 4096-wide row left the GPU a quarter occupied at 2048 rows); a warp per narrower row."""
        if D >= 1024:
            return (max(1, R),), (256,), np.int32(256)
        return (max(1, -(-R // 8)),), (256,), np.int32(32)

    def _norm_out(self, x, shape, gemm_input):
        """A norm's output buffer of ``shape`` and its kernel's name suffix: fp32 (""), or, for a GEMM's
        activation whose rows are x's leading axis, the dtype Matmul.operand_dtype names (fp16: "_h")."""
        cp = self.ctx.cp
        dtype = self.matmul.operand_dtype(x.shape[0]) if gemm_input and x.ndim > 1 else cp.float32
        return cp.empty(shape, dtype=dtype), "_h" if dtype == cp.float16 else ""

    def rmsnorm(self, x, w, eps, gemm_input=False):
        ctx = self.ctx
        x, R, D, *rmap = ctx.row_map(x)
        y, h = self._norm_out(x, tuple(x.shape), gemm_input)
        g, b, G = self._row_launch(R, D)
        ctx.kernel("norms.cu", "rmsnorm_rows" + h)(g, b, (x, *map_args(*rmap), ctx.contiguous(w), y, np.int32(R),
                                                          np.int32(D), G, np.float32(eps)))
        return y

    def add_rmsnorm(self, x, delta, w, eps, gemm_input=False):
        ctx = self.ctx
        x, d = ctx.contiguous(x), ctx.contiguous(delta)
        D = x.shape[-1]
        R = x.size // D
        s = ctx.cp.empty(x.shape, dtype=ctx.cp.float32)
        y, h = self._norm_out(x, x.shape, gemm_input)
        g, b, G = self._row_launch(R, D)
        ctx.kernel("norms.cu", "add_rmsnorm_rows" + h)(g, b, (x, d, ctx.contiguous(w), s, y, np.int32(R),
                                                              np.int32(D), G, np.float32(eps)))
        return s, y

    def gated_rmsnorm(self, x, z, w, eps, gemm_input=False):
        """x, z [..., heads, d]; both read through a row map (z is a per-head view of a wider projection)."""
        ctx = self.ctx
        shape = x.shape
        x, R, D, *rmap = ctx.row_map(x)
        z, Rz, Dz, *zmap = ctx.row_map(z)
        if (Rz, Dz) != (R, D):
            raise ValueError(f"gated_rmsnorm: z {z.shape} does not match x {shape}")
        y, h = self._norm_out(x, shape, gemm_input)
        g, b, G = self._row_launch(R, D)
        ctx.kernel("norms.cu", "gated_rmsnorm_rows" + h)(g, b, (x, *map_args(*rmap), z, *map_args(*zmap),
                                                                ctx.contiguous(w), y, np.int32(R), np.int32(D), G,
                                                                np.float32(eps)))
        return y

    def layernorm(self, x, w, b, eps=1e-5):
        ctx = self.ctx
        x, R, D, *rmap = ctx.row_map(x)
        y = ctx.cp.empty(tuple(x.shape), dtype=ctx.cp.float32)
        g, bl, G = self._row_launch(R, D)
        ctx.kernel("norms.cu", "layernorm_rows")(g, bl, (x, *map_args(*rmap), ctx.contiguous(w), ctx.contiguous(b),
                                                         y, np.int32(R), np.int32(D), G, np.float32(eps)))
        return y

    def l2norm(self, x, eps, scale=1.0):
        ctx = self.ctx
        x, R, D, *rmap = ctx.row_map(x)
        y = ctx.cp.empty(tuple(x.shape), dtype=ctx.cp.float32)
        g, b, G = self._row_launch(R, D)
        ctx.kernel("norms.cu", "l2norm_rows")(g, b, (x, *map_args(*rmap), y, np.int32(R), np.int32(D), G,
                                                     np.float32(eps), np.float32(scale)))
        return y
