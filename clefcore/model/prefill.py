"""One long prompt's backbone a chunk at a time, so that other forwards can run on the backend in between."""

from __future__ import annotations

import numpy as np

from .backbone import Block, Carry, embed_with_images, layer_block, rope
from .head import HeadReadout
from .params import Params


class ChunkedPrefill:
    """One prompt's backbone run as a sequence of token chunks, each through every layer (chunk-outer, where
    ``backbone`` is layer-outer), so that a caller can run other forwards on the same backend between two chunks.
    What the next chunk needs is carried: per GDN layer the conv tail and the delta-rule state (``Carry``), per
    attention layer its own K/V rows so far. Of each chunk's final-norm states only what the head reads is kept
    (``readout``, a HeadReadout of the rows ``head_rows``): a quarter of the whole [T, H] stream. The result equals
    ``backbone`` and ``readout`` on the whole prompt up to fp rounding, for any chunk size.

    ``step()`` runs the next chunk (its guard flags are left for the caller's ``ops.check_watched``) and returns
    True once the last one has run; ``step(tokens)`` makes that chunk ``tokens`` long instead of ``chunk`` (a
    server that sizes its steps by time changes it as the device's rate moves)."""

    def __init__(self, ops, p: Params, ids, chunk: int, head_rows, positions=None, image_rows=None,
                 image_embeds=None):
        if chunk < 1:
            raise ValueError("chunk must be at least one token")
        c = p.text
        self.ops, self.p, self.chunk = ops, p, int(chunk)
        self.ids = np.asarray(ids, dtype=np.int64)
        self.T = T = len(self.ids)
        self.t = 0
        # with images: M-RoPE positions [3, T], and the image rows' embeddings swapped in chunk by chunk
        self.image_rows = None if image_rows is None else np.asarray(image_rows, dtype=np.int64)
        self.image_embeds = image_embeds
        self.cos, self.sin = rope(ops, p, np.arange(T, dtype=np.int64) if positions is None else positions)
        self.cu = np.array([0, T], dtype=np.int64)
        attn = [kind == "full_attention" for kind in c.layer_types]
        self.caches = [(ops.kv_cache(T, c.num_kv_heads, c.head_dim), ops.kv_cache(T, c.num_kv_heads, c.head_dim))
                       if a else None for a in attn]
        self.carries = [None if a else Carry() for a in attn]
        self.readout = HeadReadout(ops, p, T, head_rows)

    @property
    def done(self) -> bool:
        return self.t >= self.T

    def step(self, tokens: int | None = None) -> bool:
        ops, p, c = self.ops, self.p, self.p.text
        size = self.chunk if tokens is None else int(tokens)
        if size < 1:
            raise ValueError("chunk must be at least one token")
        t0, t1 = self.t, min(self.t + size, self.T)
        b = Block(t0, t1, np.array([0, t1 - t0], dtype=np.int64), t0 > 0, t1 < self.T)
        rows = embeds = None
        if self.image_rows is not None:                        # this chunk's image rows, chunk-relative
            inside = np.nonzero((self.image_rows >= t0) & (self.image_rows < t1))[0]
            rows, embeds = self.image_rows[inside] - t0, self.image_embeds[ops.asarray(inside)]
        x = embed_with_images(ops, p, self.ids[t0:t1], rows, embeds)
        for i, L in enumerate(p.layers):
            layer_block(ops, c, i, L, x, b, self.cu, self.cos[t0:t1], self.sin[t0:t1], self.caches[i],
                        self.carries[i])
        hs = ops.rmsnorm(x, p.norm, c.rms_eps)
        ops.watch(hs, f"final hidden states, tokens {t0}-{t1}")
        self.readout.add(hs, t0)
        self.t = t1
        return self.done
