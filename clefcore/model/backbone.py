"""The Qwen3.5 hybrid backbone (qwen35-backbone.md §3): token embeddings (image rows swapped in), RoPE, every
layer (gated DeltaNet or gated attention, then the SwiGLU MLP) over blocks of the token stream, the final norm.

``layer_block``, ``Block`` and ``Carry`` are also what the chunked prefill (prefill.py) runs a prompt with, a
chunk at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..backends.interface import Backend
from ..config import TextConfig
from .params import Params


@dataclass(frozen=True)
class Block:
    """Tokens [t0, t1) of the packed stream. ``cu`` = block-local bounds of the (pieces of) sequences in it;
    ``cont_in``: its first piece continues a sequence from the previous block; ``cont_out``: its last piece
    continues into the next block."""

    t0: int
    t1: int
    cu: np.ndarray
    cont_in: bool
    cont_out: bool


def block_plan(cu_seqlens, T: int, block: int) -> list[Block]:
    """Cut the packed stream [0, T) into blocks of ``block`` tokens (the last may be shorter)."""
    bounds = np.unique(np.asarray(cu_seqlens, dtype=np.int64))      # drops empty sequences' duplicates
    plan = []
    for t0 in range(0, T, block):
        t1 = min(t0 + block, T)
        inner = bounds[(bounds > t0) & (bounds < t1)]
        cu = np.concatenate([[0], inner - t0, [t1 - t0]]).astype(np.int64)
        plan.append(Block(t0, t1, cu, t0 not in bounds, t1 not in bounds))
    return plan


def backbone(ops: Backend, p: Params, ids, cu_seqlens, positions, keep_layers: bool = False,
             block: int | None = None, check: bool = True, image_rows=None, image_embeds=None):
    """ids [T] (packed sequences), cu_seqlens [B+1], positions [T] -> (final-norm states [T, H], per-layer
    residual streams or None).

    With images: positions [3, T] (M-RoPE: temporal, height, width), and the token embeddings of the rows
    ``image_rows`` (host ints, the image pads in placeholder order) replaced by ``image_embeds`` [n, H] (the vision
    tower's output). Text-only calls are unchanged.

    Layer-outer, block-inner: the fp32 residual stream x [T, H] stays whole; each layer runs its input norm,
    mixer, MLP and residual adds over token blocks of ``block`` tokens (default ``ops.token_block``; 0 or None
    = the whole stream), so every other activation is [block, *]. What crosses a block boundary is carried:
    the conv's last K-1 pre-conv rows and the delta rule's state of the sequence cut by the boundary, and for
    attention the K/V cache of the whole stream (``ops.kv_cache``; rows [0, t1) are valid when block
    [t0, t1) runs). Results equal the unblocked computation up to fp rounding for any block size.

    ``check``: read the guard flags (``ops.check_watched``) before returning; a caller that queues more work
    first (the engine queues the head) passes False and calls ``ops.check_watched()`` itself.

    A backend with ``ops.graphs`` (CUDA; None on the CPU) replays one graph for the layers of a short
    single-sequence prompt. The prompt is padded at its end to the graph's bucket so that nearby lengths share a
    graph: every op is causal, so the padding changes no row before it, and it is cut off again here.
    """
    T = int(len(ids))
    if block is None:
        block = ops.token_block
    block = int(block) if block and int(block) > 0 else max(T, 1)
    graphs = ops.graphs
    if image_rows is not None:
        graphs = None                                   # the graph path replays text-only embeddings and 1-D rope
    Tp = None if keep_layers or graphs is None else graphs.padded_length(T, len(cu_seqlens) - 1)
    if Tp is not None and Tp > T:
        ids = np.concatenate([np.asarray(ids), np.zeros(Tp - T, dtype=np.asarray(ids).dtype)])
        positions = np.asarray(positions)
        positions = np.concatenate([positions, positions[-1] + 1 + np.arange(Tp - T, dtype=positions.dtype)])
        cu_seqlens = np.array([0, Tp])
    plan = block_plan(cu_seqlens, len(ids), block)
    x = embed_with_images(ops, p, ids, image_rows, image_embeds)
    cos, sin = rope(ops, p, positions)
    kept = [] if keep_layers else None

    def layers(x, cos, sin):
        _layers(ops, p, x, cu_seqlens, cos, sin, plan, kept)
        return x

    if Tp is None:
        x = layers(x, cos, sin)
    else:
        key = ("backbone", Tp, block, ops.plan)
        weights = [p.norm] + [w for L in p.layers for w in L.values()]
        x = graphs.run(key, layers, (x, cos, sin), weights)[:T].copy()   # the graph reuses its buffer next time
    if check:
        ops.check_watched()                                    # the forward's one wait for the guard flags
    return x, kept


def embed_with_images(ops, p: Params, ids, image_rows=None, image_embeds=None):
    """Token embeddings [T, H], the image pads' rows replaced by the vision tower's embeddings (in order)."""
    x = ops.embed(p.embed, ids)
    if image_rows is not None and len(image_rows):
        if image_embeds.shape != (len(image_rows), x.shape[1]):
            raise ValueError(f"image embeddings {tuple(image_embeds.shape)} for {len(image_rows)} image rows")
        x[ops.asarray(np.asarray(image_rows, dtype=np.int64))] = image_embeds
    return x


def rope(ops, p: Params, positions):
    """cos/sin [T, rotary_dim/2]: 1-D positions [T] as before; M-RoPE positions [3, T] interleaved by
    frequency (clef-images.md §9): frequency j reads the height row when j % 3 == 1 and j < 3 * section[1], the
    width row when j % 3 == 2 and j < 3 * section[2], the temporal row otherwise."""
    c = p.text
    positions = np.asarray(positions)
    if positions.ndim == 1:
        return ops.rope_tables(positions, c.rotary_dim, c.rope_theta)
    if p.mrope_section is None:
        raise ValueError("3-row positions need the text config's mrope_section")
    half = c.rotary_dim // 2
    axis = np.zeros(half, dtype=np.int64)                 # each frequency's position row
    for a in (1, 2):
        axis[a:min(3 * p.mrope_section[a], half):3] = a
    # one table from a position per (token, frequency): the same fp32 products as three 1-D tables spliced
    return ops.rope_tables(np.ascontiguousarray(positions[axis].T), c.rotary_dim, c.rope_theta)


def _layers(ops, p: Params, x, cu_seqlens, cos, sin, plan, kept):
    """Every layer, then the final norm, in place on x [T, H] (see backbone)."""
    c = p.text
    T = x.shape[0]
    cache = None
    for i, (kind, L) in enumerate(zip(c.layer_types, p.layers)):
        if kind == "full_attention" and cache is None:        # one K/V cache, reused by every attention layer
            cache = (ops.kv_cache(T, c.num_kv_heads, c.head_dim), ops.kv_cache(T, c.num_kv_heads, c.head_dim))
        carry = Carry()
        for b in plan:
            layer_block(ops, c, i, L, x[b.t0:b.t1], b, cu_seqlens, cos[b.t0:b.t1], sin[b.t0:b.t1], cache, carry)
        if kept is not None:
            kept.append(x.copy())
    del cache
    for b in plan:                                             # final norm, in place: x becomes the output
        x[b.t0:b.t1] = ops.rmsnorm(x[b.t0:b.t1], p.norm, c.rms_eps)
    ops.watch(x, "final hidden states")


def layer_block(ops, c: TextConfig, i: int, L: dict, xb, b: Block, cu_seqlens, cos, sin, cache, carry):
    """Layer i over the rows [b.t0, b.t1) of the stream, in place on xb (those rows of the residual stream): the
    mixer (attention reads and writes ``cache``, the GDN ``carry``), the MLP, both residual adds."""
    kind = c.layer_types[i]
    # the norms' outputs (and the attention's gated output) only feed weight GEMMs: gemm_input lets a backend
    # write them as those GEMMs take them (the interface's rmsnorm)
    h = ops.rmsnorm(xb, L["input_layernorm.weight"], c.rms_eps, gemm_input=True)
    if kind == "full_attention":
        mixed = full_attention(ops, c, L, h, cu_seqlens, cos, sin, b.t0, cache)
    else:
        mixed = gated_deltanet(ops, c, L, h, b, carry)
    # a dead or overflowing kernel must fail the request, not answer it (flags read once, at the end)
    ops.watch(mixed, f"layer {i} ({kind}) output, tokens {b.t0}-{b.t1}")
    del h
    s, h = ops.add_rmsnorm(xb, mixed, L["post_attention_layernorm.weight"], c.rms_eps, gemm_input=True)
    del mixed
    m = ops.mlp(h, L["mlp.gate_proj.weight"], L["mlp.up_proj.weight"], L["mlp.down_proj.weight"])
    ops.watch(m, f"layer {i} MLP output, tokens {b.t0}-{b.t1}")
    del h
    ops.xp.add(s, m, out=xb)                                   # x[t0:t1] = (x + mixer) + mlp, in place


class Carry:
    """What a GDN layer carries from one block to the next (only for the sequence cut by the boundary)."""

    def __init__(self):
        self.conv = None     # [K-1, conv_dim]: pre-conv rows before the next block's first row
        self.state = None    # [Hv, dk, dv]: delta-rule state after the previous block's last row


def full_attention(ops, c: TextConfig, L: dict, h, cu_seqlens, cos, sin, t0: int = 0, cache=None):
    """Gated attention for the rows [t0, t0 + n) of the packed stream (h [n, H], cos/sin of those rows).
    With ``cache`` = (K, V) of the whole stream, this block's keys/values are written at rows t0.. and its
    queries attend to the keys of their sequence up to themselves; without it, h is the whole stream."""
    n, D = h.shape[0], c.head_dim
    nq, nk = 2 * c.num_heads * D, c.num_kv_heads * D
    qkv = ops.linear(h, L["self_attn.qkv_proj.weight"])           # [n, q_proj | k_proj | v_proj] (FUSED)
    # q_proj rows are per head [query_h ; gate_h], not [all queries ; all gates]
    qg = qkv[:, :nq].reshape(n, c.num_heads, 2, D)
    q, gate = qg[:, :, 0], qg[:, :, 1]
    k = qkv[:, nq:nq + nk].reshape(n, c.num_kv_heads, D)
    v = qkv[:, nq + nk:].reshape(n, c.num_kv_heads, D)
    q = ops.rotary(ops.rmsnorm(q, L["self_attn.q_norm.weight"], c.rms_eps), cos, sin)
    k = ops.rotary(ops.rmsnorm(k, L["self_attn.k_norm.weight"], c.rms_eps), cos, sin)
    if cache is not None:
        ops.kv_write(cache[0], t0, k)
        ops.kv_write(cache[1], t0, v)
        k, v = cache
    o = ops.attention(q, k, v, cu_seqlens, 1.0 / math.sqrt(D), q_offset=t0)
    del q, k, v
    o = ops.sigmoid_gate(o, gate, gemm_input=True)
    del qkv, qg, gate
    return ops.linear(o.reshape(n, c.num_heads * D), L["self_attn.o_proj.weight"])


def gated_deltanet(ops, c: TextConfig, L: dict, h, b: Block, carry: Carry | None = None):
    """Gated DeltaNet over one block (h [n, H]); ``b`` says where its sequences start and end, ``carry`` holds
    what the previous block of the same sequence left (and receives what the next block needs)."""
    n = h.shape[0]
    hk, dk, hv, dv = c.lin_k_heads, c.lin_k_dim, c.lin_v_heads, c.lin_v_dim
    kd = hk * dk
    carry = carry if carry is not None else Carry()
    cd, zd = c.conv_dim, hv * dv
    proj = ops.linear(h, L["linear_attn.in_proj.weight"])         # [n, qkv | z | a | b] (FUSED)
    pre = proj[:, :cd]
    w_conv = L["linear_attn.conv1d.weight"]
    prev = carry.conv if b.cont_in else None
    mixed = ops.conv1d_silu(pre, w_conv, b.cu, prev=prev)
    if b.cont_out:
        carry.conv = _conv_tail(ops.xp, prev, pre, int(b.cu[-2]), w_conv.shape[1] - 1)
    del pre
    q = ops.l2norm(mixed[:, :kd].reshape(n, hk, dk), 1e-6, 1.0 / math.sqrt(dk))
    k = ops.l2norm(mixed[:, kd:2 * kd].reshape(n, hk, dk), 1e-6)
    v = mixed[:, 2 * kd:].reshape(n, hv, dv)
    g, beta = ops.gdn_gates(proj[:, cd + zd:cd + zd + hv], proj[:, cd + zd + hv:],
                            L["linear_attn.A_log"], L["linear_attn.dt_bias"])
    o = _delta_rule_block(ops, q, k, v, g, beta, b, carry)
    del q, k, v, g, beta, mixed
    y = ops.gated_rmsnorm(o, proj[:, cd:cd + zd].reshape(n, hv, dv), L["linear_attn.norm.weight"], c.rms_eps,
                          gemm_input=True)
    del o, proj
    return ops.linear(y.reshape(n, hv * dv), L["linear_attn.out_proj.weight"])


def _conv_tail(xp, prev, pre, last_start: int, K1: int):
    """The K1 pre-conv rows that end at the block's last row, inside its last sequence (zeros before that
    sequence's start). ``last_start`` = the last piece's first row; when that piece is the block's first and
    continues a sequence (``prev`` given), rows before the block come from ``prev``."""
    n = pre.shape[0]
    from_prev = prev is not None and last_start == 0
    lo = max(n - K1, 0 if from_prev else last_start)
    tail = xp.zeros((K1, pre.shape[1]), dtype=np.float32)
    if n > lo:
        tail[K1 - (n - lo):] = pre[lo:]
    if from_prev and n < K1:
        tail[:K1 - n] = prev[n:]
    return tail


def _delta_rule_block(ops, q, k, v, g, beta, b: Block, carry: Carry):
    """The delta rule over one block in one call: every piece starts from a zero state except the one that
    continues from the previous block (the carried state); when the last piece continues into the next block,
    its final state is kept in ``carry``."""
    if not b.cont_in and not b.cont_out:
        return ops.gated_delta_rule(q, k, v, g, beta, b.cu)
    state = ops.xp.zeros((len(b.cu) - 1, v.shape[1], k.shape[2], v.shape[2]), dtype=np.float32)
    if b.cont_in:
        state[0] = carry.state
    o = ops.gated_delta_rule(q, k, v, g, beta, b.cu, state=state)
    if b.cont_out:
        carry.state = state[-1].copy()
    return o
