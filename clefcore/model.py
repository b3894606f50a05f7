"""Clef-flash, the whole model: Qwen3.5 hybrid backbone + joint schema head.

Written once against the backend interface (``clefcore.backends.interface.Backend``: ``clefcore.backends.cpu``
is the fp32 reference, ``clefcore.backends.cuda`` the GPU one). ``ops.xp`` is the backend's array module, so the
reshapes and slices below run unchanged on numpy and CuPy arrays. The math follows the specs:
backbone = qwen35-backbone.md §3, head = clef-head.md §5.3 (step numbers quoted in comments).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .backends.interface import Backend
from .checkpoint import Checkpoint, stack_refs
from .config import HeadConfig, TextConfig


# Projections that read the same input are stacked by rows at load and run as one GEMM: one pass over the
# input instead of four or three (the narrow ones, num_v_heads or kv heads wide, use the tensor cores badly
# alone). gated_deltanet and full_attention slice the product; the norms read the slices in place.
FUSED = {
    "linear_attn.in_proj.weight": ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
                                   "linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight"),
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
}


@dataclass
class Params:
    """Backend-native weights. ``layers[i]`` maps the checkpoint's per-layer names (without ``layers.{i}.``)
    to arrays, a FUSED group under its fused name; conv weights are squeezed to [C, K]."""

    text: TextConfig
    head_config: HeadConfig
    embed: object
    norm: object
    lm_head: object
    layers: list[dict] = field(default_factory=list)
    head: dict = field(default_factory=dict)
    # M-RoPE (requests with images): rope_parameters.mrope_section of the text config, interleaved
    mrope_section: tuple[int, int, int] | None = None

    def place(self, name: str, w) -> None:
        """Store a backbone tensor under its checkpoint name (without the language-model prefix)."""
        if name == "embed_tokens.weight":
            self.embed = w
        elif name == "lm_head.weight":
            self.lm_head = w
        elif name == "norm.weight":
            self.norm = w
        else:
            _, i, rest = name.split(".", 2)
            self.layers[int(i)][rest] = w


def stored_groups(names) -> list[tuple[str, list[str]]]:
    """Checkpoint tensor names (``layers.{i}.<rest>``, ...) -> [(name in Params, [its checkpoint tensors])] in
    checkpoint order: the parts of a FUSED group become one entry, at the position of its first part."""
    names = list(names)
    present, out, taken = set(names), [], set()
    for n in names:
        if n in taken:
            continue
        group = [n]
        if n.startswith("layers."):
            _, i, rest = n.split(".", 2)
            for fused, parts in FUSED.items():
                full = [f"layers.{i}.{q}" for q in parts]
                if rest in parts and all(q in present for q in full):
                    n, group = f"layers.{i}.{fused}", full
                    break
        taken.update(group)
        out.append((n, group))
    return out


def load_params(ck: Checkpoint, ops, progress=None) -> Params:
    """Convert every tensor once, in checkpoint order, into the backend's storage (``ops.weight`` takes the
    memory-mapped TensorRef, so each backend reads the file's bytes once, in its own way)."""
    names = list(ck.text_tensors) + list(ck.head_tensors)
    done = 0

    def tick(n):
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, len(names), n)

    layers = [dict() for _ in range(ck.text.num_layers)]
    p = Params(ck.text, ck.head_config, None, None, None, layers)
    for name, parts in stored_groups(ck.text_tensors):
        if name in ("embed_tokens.weight", "lm_head.weight"):
            w = ops.table(ck.text_tensors[name])       # large vocab tables: the backend decides where they live
        elif name.endswith("conv1d.weight"):
            w = ops.weight(ck.text_f32(name)[:, 0, :])
        else:                                          # the backend converts (the GPU from bf16 bits, on device);
            w = ops.weight(stack_refs(name, [ck.text_tensors[n] for n in parts]))   # FUSED parts stacked on host
        p.place(name, w)
        for n in parts:
            tick(n)
    for name in ck.head_tensors:
        p.head[name] = ops.weight(ck.head_tensors[name])
        tick(name)
    return p


# ------------------------------------------------------------------------------------------------- backbone

@dataclass(frozen=True)
class _Block:
    """Tokens [t0, t1) of the packed stream. ``cu`` = block-local bounds of the (pieces of) sequences in it;
    ``cont_in``: its first piece continues a sequence from the previous block; ``cont_out``: its last piece
    continues into the next block."""

    t0: int
    t1: int
    cu: np.ndarray
    cont_in: bool
    cont_out: bool


def block_plan(cu_seqlens, T: int, block: int) -> list[_Block]:
    """Cut the packed stream [0, T) into blocks of ``block`` tokens (the last may be shorter)."""
    bounds = np.unique(np.asarray(cu_seqlens, dtype=np.int64))      # drops empty sequences' duplicates
    plan = []
    for t0 in range(0, T, block):
        t1 = min(t0 + block, T)
        inner = bounds[(bounds > t0) & (bounds < t1)]
        cu = np.concatenate([[0], inner - t0, [t1 - t0]]).astype(np.int64)
        plan.append(_Block(t0, t1, cu, t0 not in bounds, t1 not in bounds))
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
        carry = _Carry()
        for b in plan:
            _layer_block(ops, c, i, L, x[b.t0:b.t1], b, cu_seqlens, cos[b.t0:b.t1], sin[b.t0:b.t1], cache, carry)
        if kept is not None:
            kept.append(x.copy())
    del cache
    for b in plan:                                             # final norm, in place: x becomes the output
        x[b.t0:b.t1] = ops.rmsnorm(x[b.t0:b.t1], p.norm, c.rms_eps)
    ops.watch(x, "final hidden states")


def _layer_block(ops, c: TextConfig, i: int, L: dict, xb, b: _Block, cu_seqlens, cos, sin, cache, carry):
    """Layer i over the rows [b.t0, b.t1) of the stream, in place on xb (those rows of the residual stream): the
    mixer (attention reads and writes ``cache``, the GDN ``carry``), the MLP, both residual adds."""
    kind = c.layer_types[i]
    h = ops.rmsnorm(xb, L["input_layernorm.weight"], c.rms_eps)
    if kind == "full_attention":
        mixed = full_attention(ops, c, L, h, cu_seqlens, cos, sin, b.t0, cache)
    else:
        mixed = gated_deltanet(ops, c, L, h, b, carry)
    # a dead or overflowing kernel must fail the request, not answer it (flags read once, at the end)
    ops.watch(mixed, f"layer {i} ({kind}) output, tokens {b.t0}-{b.t1}")
    del h
    s, h = ops.add_rmsnorm(xb, mixed, L["post_attention_layernorm.weight"], c.rms_eps)
    del mixed
    m = ops.mlp(h, L["mlp.gate_proj.weight"], L["mlp.up_proj.weight"], L["mlp.down_proj.weight"])
    ops.watch(m, f"layer {i} MLP output, tokens {b.t0}-{b.t1}")
    del h
    ops.xp.add(s, m, out=xb)                                   # x[t0:t1] = (x + mixer) + mlp, in place


class ChunkedPrefill:
    """One prompt's backbone run as a sequence of token chunks, each through every layer (chunk-outer, where
    ``backbone`` is layer-outer), so that a caller can run other forwards on the same backend between two chunks.
    What the next chunk needs is carried: per GDN layer the conv tail and the delta-rule state (``_Carry``), per
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
        self.carries = [None if a else _Carry() for a in attn]
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
        b = _Block(t0, t1, np.array([0, t1 - t0], dtype=np.int64), t0 > 0, t1 < self.T)
        rows = embeds = None
        if self.image_rows is not None:                        # this chunk's image rows, chunk-relative
            inside = np.nonzero((self.image_rows >= t0) & (self.image_rows < t1))[0]
            rows, embeds = self.image_rows[inside] - t0, self.image_embeds[ops.asarray(inside)]
        x = embed_with_images(ops, p, self.ids[t0:t1], rows, embeds)
        for i, L in enumerate(p.layers):
            _layer_block(ops, c, i, L, x, b, self.cu, self.cos[t0:t1], self.sin[t0:t1], self.caches[i],
                         self.carries[i])
        hs = ops.rmsnorm(x, p.norm, c.rms_eps)
        ops.watch(hs, f"final hidden states, tokens {t0}-{t1}")
        self.readout.add(hs, t0)
        self.t = t1
        return self.done


class _Carry:
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
    o = ops.sigmoid_gate(o, gate)
    del qkv, qg, gate
    return ops.linear(o.reshape(n, c.num_heads * D), L["self_attn.o_proj.weight"])


def gated_deltanet(ops, c: TextConfig, L: dict, h, b: _Block, carry: _Carry | None = None):
    """Gated DeltaNet over one block (h [n, H]); ``b`` says where its sequences start and end, ``carry`` holds
    what the previous block of the same sequence left (and receives what the next block needs)."""
    n = h.shape[0]
    hk, dk, hv, dv = c.lin_k_heads, c.lin_k_dim, c.lin_v_heads, c.lin_v_dim
    kd = hk * dk
    carry = carry if carry is not None else _Carry()
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
    y = ops.gated_rmsnorm(o, proj[:, cd:cd + zd].reshape(n, hv, dv), L["linear_attn.norm.weight"], c.rms_eps)
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


def _delta_rule_block(ops, q, k, v, g, beta, b: _Block, carry: _Carry):
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


# ----------------------------------------------------------------------------------------------------- head

def head_rows(cu_seqlens, questions_of) -> np.ndarray:
    """The rows of a packed stream that the joint head reads one by one (each sequence's last row, the rows of
    its question and option spans), sorted and unique; besides them it reads every row's memory projection."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    spans = [np.arange(cu[b] + s, cu[b] + e) for b, qs in enumerate(questions_of)
             for q in qs for s, e in [q.question_span, *q.option_spans]]
    return np.unique(np.concatenate([cu[1:] - 1, *spans]).astype(np.int64))


class HeadReadout:
    """What the joint head reads of the final-norm states hs [T, H]: the memory projection of every row
    (``mem`` [T, M], step 2 of ``heads_from``) and the layer-normed rows ``rows`` (``picked`` [len(rows), H]).
    Filled block by block (``add``), so that a chunked prefill never holds hs whole; layernorm and the
    projection act row by row, so the blocks do not change a value."""

    def __init__(self, ops: Backend, p: Params, T: int, rows):
        P = p.head
        self.ops, self.p, self.rows = ops, p, np.asarray(rows, dtype=np.int64)
        self.mem = ops.xp.empty((T, P["memory_projection.weight"].shape[0]), dtype=np.float32)
        self.picked = ops.xp.empty((len(self.rows), p.text.hidden_size), dtype=np.float32)

    def norm(self, x):
        P = self.p.head
        return self.ops.layernorm(x, P["hidden_norm.weight"], P["hidden_norm.bias"])

    def add(self, hs, t0: int) -> None:
        """The rows [t0, t0 + len(hs)) of the stream."""
        ops, t1 = self.ops, t0 + hs.shape[0]
        self.mem[t0:t1] = ops.linear(self.norm(hs), self.p.head["memory_projection.weight"])
        lo, hi = np.searchsorted(self.rows, [t0, t1])
        if hi > lo:
            self.picked[lo:hi] = self.norm(ops.gather_rows(hs, self.rows[lo:hi] - t0))

    def take(self, rows):
        """The normed rows ``rows`` (each one of ``self.rows``)."""
        return self.ops.gather_rows(self.picked, np.searchsorted(self.rows, rows))


def readout(ops: Backend, p: Params, hs, rows) -> HeadReadout:
    """HeadReadout of a whole stream hs [T, H], in blocks of the backend's token block."""
    T = hs.shape[0]
    out = HeadReadout(ops, p, T, rows)
    block = ops.token_block or max(T, 1)
    for t0 in range(0, T, block):
        out.add(hs[t0:t0 + block], t0)
    return out


def heads(ops: Backend, p: Params, hs, ids, cu_seqlens, questions_of) -> list:
    """Joint schema head for every sequence of a packed stream in one pass. hs [T, H] final-norm states,
    ids [T] (host ints), cu_seqlens [B+1], questions_of[b]: sequence b's EncodedQuestions (spans relative to its
    start). Returns, per sequence, one logit vector (host fp32) per question."""
    return heads_from(ops, p, readout(ops, p, hs, head_rows(cu_seqlens, questions_of)), ids, cu_seqlens,
                      questions_of)


def heads_from(ops: Backend, p: Params, seen: HeadReadout, ids, cu_seqlens, questions_of) -> list:
    """``heads`` on what it reads of the stream (``seen``: ``readout``, or a chunked prefill's).

    The head's rows (options, questions) of all sequences are stacked; where it mixes rows it stays inside a
    sequence: its attentions take group ids (options and questions attend to their own sequence's memory and
    questions only), the option softmax runs per question, the last-row vector is the sequence's own."""
    xp, P, hc = ops.xp, p.head, p.head_config
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    B = len(cu) - 1
    qs = [(b, q) for b in range(B) for q in questions_of[b]]
    nq = len(qs)
    q_seq = np.array([b for b, _ in qs], dtype=np.int64)                     # sequence of each question
    owner = np.concatenate([np.full(len(q.option_spans), i) for i, (_, q) in enumerate(qs)])  # question of option
    o_starts = np.array([cu[b] + s for b, q in qs for s, _ in q.option_spans], dtype=np.int64)
    o_ends = np.array([cu[b] + e for b, q in qs for _, e in q.option_spans], dtype=np.int64)
    types = np.array([q.type_index for _, q in qs])
    mem_seq = np.repeat(np.arange(B), np.diff(cu))                             # sequence of each memory row
    opt_seq = q_seq[owner]

    # 1: X = layernorm(hs) is never formed for all T rows: the memory is projected block by block (2), and
    # the last rows (3) and the span means (4, 5) read the normalised rows of their spans only (HeadReadout)
    mem = seen.mem                                                                            # 2
    g = seen.take(cu[1:] - 1)[ops.asarray(q_seq)]                                             # 3, per question
    q_starts = np.array([cu[b] + q.question_span[0] for b, q in qs], dtype=np.int64)
    q_ends = np.array([cu[b] + q.question_span[1] for b, q in qs], dtype=np.int64)
    span_s, span_e = np.concatenate([q_starts, o_starts]), np.concatenate([q_ends, o_ends])
    rows = np.concatenate([np.arange(s, e) for s, e in zip(span_s, span_e)] + [np.zeros(0, np.int64)])
    span_offs = np.concatenate([[0], np.cumsum(span_e - span_s)])
    means = ops.span_means(seen.take(rows), span_offs[:-1], span_offs[1:])
    qv, ctx = means[:nq], means[nq:]                                                          # 4, 5
    # 6: LM-head rows of the option tokens, gathered once, then averaged per span
    tok = np.concatenate([ids[s:e] for s, e in zip(o_starts, o_ends)])
    lens = o_ends - o_starts
    offs = np.concatenate([[0], np.cumsum(lens)])
    lx = ops.span_means(ops.gather_rows(p.lm_head, tok), offs[:-1], offs[1:])
    own = ops.asarray(owner)
    r = (ops.linear(ctx, P["option_context_projection.weight"])                               # 7
         + ops.linear(lx, P["option_lexical_projection.weight"])
         + ops.linear(qv, P["option_question_projection.weight"])[own])
    for i in range(hc.routing_layers):                                                        # 8
        e = f"evidence_layers.{i}."
        mi = ops.layernorm(mem, P[e + "memory_norm.weight"], P[e + "memory_norm.bias"])
        r = r + _mha(ops, P, e + "attention.",
                     ops.layernorm(r, P[e + "query_norm.weight"], P[e + "query_norm.bias"]), mi, hc.heads,
                     (opt_seq, mem_seq))
        y = ops.layernorm(r, P[e + "feedforward_norm.weight"], P[e + "feedforward_norm.bias"])
        r = r + ops.linear(ops.gelu(ops.linear(y, P[e + "feedforward.0.weight"], P[e + "feedforward.0.bias"])),
                           P[e + "feedforward.3.weight"], P[e + "feedforward.3.bias"])
    b = ops.linear(qv, P["question_projection.weight"])                                       # 9
    scores = xp.sum(r * b[own], axis=-1) / np.float32(math.sqrt(hc.width))                    # 10
    s = ops.segment_softmax_sum(scores, r, own, nq)
    f = (b + ops.layernorm(s, P["option_summary_norm.weight"], P["option_summary_norm.bias"])  # 11
         + ops.linear(g, P["global_projection.weight"]) + P["type_embedding.weight"][ops.asarray(types)])
    for j in range(hc.layers):                                                                # 12
        d = f"layers.{j}."
        y = ops.layernorm(f, P[d + "norm1.weight"], P[d + "norm1.bias"])
        f = f + _mha(ops, P, d + "self_attn.", y, y, hc.heads, (q_seq, q_seq))
        f = f + _mha(ops, P, d + "multihead_attn.",
                     ops.layernorm(f, P[d + "norm2.weight"], P[d + "norm2.bias"]), mem, hc.heads, (q_seq, mem_seq))
        y = ops.layernorm(f, P[d + "norm3.weight"], P[d + "norm3.bias"])
        f = f + ops.linear(ops.gelu(ops.linear(y, P[d + "linear1.weight"], P[d + "linear1.bias"])),
                           P[d + "linear2.weight"], P[d + "linear2.bias"])
    f = ops.layernorm(f, P["field_norm.weight"], P["field_norm.bias"])                        # 13
    ln100 = np.float32(math.log(100.0))
    sp = xp.exp(xp.minimum(P["prior_logit_scale"], ln100))
    sj = xp.exp(xp.minimum(P["joint_logit_scale"], ln100))
    anchor = ops.normalize(qv + g, 1e-12)                                                     # 14
    prior = sp * xp.sum(ops.normalize(lx, 1e-12) * anchor[own], axis=-1)
    u = ops.layernorm(r, P["option_norm.weight"], P["option_norm.bias"])                     # 15
    fo = f[own]
    cos = xp.sum(ops.normalize(fo, 1e-8) * ops.normalize(u, 1e-8), axis=-1)
    feat = xp.concatenate([fo, u, fo * u, xp.abs(fo - u)], axis=-1)
    res = ops.linear(ops.gelu(ops.linear(feat, P["residual_scorer.0.weight"], P["residual_scorer.0.bias"])),
                     P["residual_scorer.3.weight"], P["residual_scorer.3.bias"])[:, 0]
    z = prior + ops.sigmoid(P["residual_gate"]) * (sj * cos + res)                           # 16
    z = ops.to_host(z).astype(np.float32)
    per_q = [z[owner == i] for i in range(nq)]
    return [[per_q[i] for i in np.nonzero(q_seq == b_)[0]] for b_ in range(B)]


def _mha(ops, P, prefix, xq, xkv, heads, groups):
    return ops.mha(xq, xkv, P[prefix + "in_proj_weight"], P[prefix + "in_proj_bias"],
                   P[prefix + "out_proj.weight"], P[prefix + "out_proj.bias"], heads, groups)
