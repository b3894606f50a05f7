"""The joint schema head (clef-head.md §5.3; step numbers quoted in comments): from the backbone's final-norm
states to one logit vector per question, for every sequence of a packed stream at once.

What the head does with a stream is fixed by the stream's layout alone (its sequences' bounds and questions, never
its tokens or states): ``HeadLayout`` works it out on the host, every index table the head's ops read packed into
one int64 array that goes to the device in one upload. On a backend with head graphs (CUDA, the head_graph kernel
switch) a layout seen before replays a CUDA graph (``heads``): the layout names the graph, and the states, the
option tokens' LM-head rows and the index table are its inputs, copied into its static buffers before each replay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from ..backends.interface import Backend, Graphs
from .params import Params


def head_rows(cu_seqlens, questions_of) -> np.ndarray:
    """The rows of a packed stream that the joint head reads one by one (each sequence's last row, the rows of
    its question and option spans), sorted and unique; besides them it reads every row's memory projection."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    spans = [np.arange(cu[b] + s, cu[b] + e) for b, qs in enumerate(questions_of)
             for q in qs for s, e in [q.question_span, *q.option_spans]]
    return np.unique(np.concatenate([cu[1:] - 1, *spans]).astype(np.int64))


@dataclass(frozen=True)
class HeadIndex:
    """The index tables the head's ops read: host int64 arrays (``HeadLayout.host``), or views of their one upload
    (``HeadLayout.views``). Positions "among the head rows" index ``HeadLayout.rows`` (the readout's ``picked``)."""

    local: Any          # per head row: its index within its token block of the readout (HeadReadout.add)
    last: Any           # per question: its sequence's last row, as a position among the head rows
    span_rows: Any      # the rows of every question span, then of every option span, as positions among the head rows
    span_starts: Any    # per span: its [start, end) in span_rows
    span_ends: Any
    lex_starts: Any     # per option: its [start, end) among the option tokens (HeadLayout.option_tokens)
    lex_ends: Any
    owner: Any          # per option: its question (non-decreasing: the options are stacked question by question)
    types: Any          # per question: its type index (noul 0, choice 1, score 2)
    q_seq: Any          # per question: its sequence; with opt_seq and mem_seq the attentions' groups
    opt_seq: Any        # per option: its sequence
    mem_seq: Any        # per row of the stream: its sequence


@dataclass(frozen=True)
class LayoutKey:
    """``HeadLayout.key``: equal for equal layouts, hashable, printed short (the graph cache logs it). ``block``:
    the readout's token block; ``cu``: the sequences' bounds; ``questions``: per sequence, per question, its type
    index, question span and option spans (relative to its sequence's start)."""

    block: int
    cu: tuple
    questions: tuple

    def __repr__(self) -> str:
        qs = [q for seq in self.questions for q in seq]
        return (f"joint head layout ({self.cu[-1]} tokens, {len(self.cu) - 1} sequences, {len(qs)} questions, "
                f"{sum(len(q[2]) for q in qs)} options)")


def _span(s) -> tuple[int, int]:
    return int(s[0]), int(s[1])


class HeadLayout:
    """The joint head's work for one packed stream, from its bounds ``cu_seqlens`` and each sequence's questions
    alone; ``block``: the backend's token block (the readout's, HeadReadout.add).

    ``rows``: the head rows (``head_rows``); ``host``: the index tables (HeadIndex of host arrays), packed into
    ``table`` (int64) and read back through ``views``; ``key``: the layout (LayoutKey). Two streams with the
    same key run the head's launches in the same order on the same shapes (the token count, the head rows, the
    attentions' groups and the spans fix them): the key names the head's CUDA graph, with the plan."""

    def __init__(self, cu_seqlens, questions_of, block: int):
        cu = np.asarray(cu_seqlens, dtype=np.int64)
        B = len(cu) - 1
        qs = [(b, q) for b in range(B) for q in questions_of[b]]
        self.T, self.B, self.nq = int(cu[-1]), B, len(qs)
        self.rows = head_rows(cu, questions_of)
        q_seq = np.array([b for b, _ in qs], dtype=np.int64)                          # sequence of each question
        owner = np.concatenate([np.full(len(q.option_spans), i) for i, (_, q) in enumerate(qs)])  # question of option
        self.option_spans = (np.array([cu[b] + s for b, q in qs for s, _ in q.option_spans], dtype=np.int64),
                             np.array([cu[b] + e for b, q in qs for _, e in q.option_spans], dtype=np.int64))
        o_starts, o_ends = self.option_spans
        q_starts = np.array([cu[b] + q.question_span[0] for b, q in qs], dtype=np.int64)
        q_ends = np.array([cu[b] + q.question_span[1] for b, q in qs], dtype=np.int64)
        span_s, span_e = np.concatenate([q_starts, o_starts]), np.concatenate([q_ends, o_ends])
        span_rows = np.concatenate([np.arange(s, e) for s, e in zip(span_s, span_e)] + [np.zeros(0, np.int64)])
        span_offs = np.concatenate([[0], np.cumsum(span_e - span_s)])
        lex_offs = np.concatenate([[0], np.cumsum(o_ends - o_starts)])
        blk = block or max(self.T, 1)                     # readout's blocks: [0, blk), [blk, 2 blk), ...
        self.host = HeadIndex(
            local=self.rows % blk, last=np.searchsorted(self.rows, (cu[1:] - 1)[q_seq]),
            span_rows=np.searchsorted(self.rows, span_rows), span_starts=span_offs[:-1], span_ends=span_offs[1:],
            lex_starts=lex_offs[:-1], lex_ends=lex_offs[1:], owner=owner,
            types=np.array([q.type_index for _, q in qs], dtype=np.int64), q_seq=q_seq, opt_seq=q_seq[owner],
            mem_seq=np.repeat(np.arange(B), np.diff(cu)))
        parts = [np.asarray(getattr(self.host, f.name), dtype=np.int64) for f in fields(HeadIndex)]
        self._bounds = np.concatenate([[0], np.cumsum([len(a) for a in parts])]).tolist()
        self.table = np.concatenate(parts)
        self.key = LayoutKey(blk, tuple(cu.tolist()), tuple(
            tuple((int(q.type_index), _span(q.question_span), tuple(_span(o) for o in q.option_spans))
                  for q in questions_of[b]) for b in range(B)))

    def views(self, table) -> HeadIndex:
        """The index tables as views of ``table`` (``self.table`` as the backend's array)."""
        b = self._bounds
        return HeadIndex(*(table[b[i]:b[i + 1]] for i in range(len(b) - 1)))

    def option_tokens(self, ids) -> np.ndarray:
        """The token ids of every option span, in option order (host ints): the rows step 6 reads of the LM head."""
        return np.concatenate([ids[s:e] for s, e in zip(*self.option_spans)])

    def logits(self, z) -> list:
        """Every option's logit (host) -> per sequence, one fp32 logit vector per question."""
        z = np.asarray(z).astype(np.float32)
        owner, q_seq = self.host.owner, self.host.q_seq
        per_q = [z[owner == i] for i in range(self.nq)]
        return [[per_q[i] for i in np.nonzero(q_seq == b)[0]] for b in range(self.B)]


class HeadReadout:
    """What the joint head reads of the final-norm states hs [T, H]: the memory projection of every row
    (``mem`` [T, M], step 2 of ``_joint``) and the layer-normed rows ``rows`` (``picked`` [len(rows), H]).
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

    def add(self, hs, t0: int, local=None) -> None:
        """The rows [t0, t0 + len(hs)) of the stream. ``local``: every head row's index within its block, as the
        backend's array (HeadIndex.local), where the caller holds it; else made here."""
        ops, t1 = self.ops, t0 + hs.shape[0]
        self.mem[t0:t1] = ops.linear(self.norm(hs), self.p.head["memory_projection.weight"])
        lo, hi = np.searchsorted(self.rows, [t0, t1])
        if hi > lo:
            ix = self.rows[lo:hi] - t0 if local is None else local[lo:hi]
            self.picked[lo:hi] = self.norm(ops.gather_rows(hs, ix))


def readout(ops: Backend, p: Params, hs, rows, local=None) -> HeadReadout:
    """HeadReadout of a whole stream hs [T, H], in blocks of the backend's token block (``local``: see add)."""
    T = hs.shape[0]
    out = HeadReadout(ops, p, T, rows)
    block = ops.token_block or max(T, 1)
    for t0 in range(0, T, block):
        out.add(hs[t0:t0 + block], t0, local)
    return out


def heads(ops: Backend, p: Params, hs, ids, cu_seqlens, questions_of) -> list:
    """Joint schema head for every sequence of a packed stream in one pass. hs [T, H] final-norm states,
    ids [T] (host ints), cu_seqlens [B+1], questions_of[b]: sequence b's EncodedQuestions (spans relative to its
    start). Returns, per sequence, one logit vector (host fp32) per question.

    Where ``graphs_for`` gives a cache, the head runs as its layout's CUDA graph: eagerly the first time the
    layout is seen, captured the second, replayed from then on (graphs.py's GraphCache, which also runs a layout
    eagerly, logged, where its capture fails)."""
    lay = HeadLayout(cu_seqlens, questions_of, ops.token_block)
    # the inputs: the states, the option tokens' LM-head rows (gathered from the table, wherever it lives) and
    # the index tables, each made outside any capture
    inputs = (hs, ops.gather_rows(p.lm_head, lay.option_tokens(ids)), ops.asarray(lay.table))
    graphs = graphs_for(ops, lay)
    if graphs is None:
        z = _head(ops, p, lay, *inputs)
    else:
        z = graphs.run((lay.key, ops.plan), lambda *a: _head(ops, p, lay, *a), inputs, list(p.head.values()))
    return lay.logits(ops.to_host(z))      # the graph's output buffer is read before its next replay


def graphs_for(ops: Backend, lay: HeadLayout) -> Graphs | None:
    """Where the head's launches go, decided here only: the backend's head graphs (CUDA with the head_graph switch
    on) when the stream is within their token limit, else None: launched from Python one by one."""
    g = ops.head_graphs
    return g if g is not None and g.fits(lay.T) else None


def heads_from(ops: Backend, p: Params, seen: HeadReadout, ids, cu_seqlens, questions_of) -> list:
    """``heads`` on what a chunked prefill has read of the stream (``seen``); its launches run one by one."""
    lay = HeadLayout(cu_seqlens, questions_of, ops.token_block)
    lex = ops.gather_rows(p.lm_head, lay.option_tokens(ids))
    z = _joint(ops, p, lay, seen, lex, lay.views(ops.asarray(lay.table)))
    return lay.logits(ops.to_host(z))


def _head(ops: Backend, p: Params, lay: HeadLayout, hs, lex, table):
    """The head of a whole stream: its readout (1, 2), then ``_joint``. Everything it reads is an argument or a
    weight, and it reads nothing back to the host: what a graph of the layout captures."""
    ix = lay.views(table)
    return _joint(ops, p, lay, readout(ops, p, hs, lay.rows, ix.local), lex, ix)


def _joint(ops: Backend, p: Params, lay: HeadLayout, seen: HeadReadout, lex, ix: HeadIndex):
    """The logit of every option (the backend's array [options]) from the readout ``seen``, the option tokens'
    LM-head rows ``lex`` and the index tables ``ix`` (views of the layout's upload).

    The head's rows (options, questions) of all sequences are stacked; where it mixes rows it stays inside a
    sequence: its attentions take group ids (options and questions attend to their own sequence's memory and
    questions only), the option softmax runs per question, the last-row vector is the sequence's own."""
    xp, P, hc, h, nq = ops.xp, p.head, p.head_config, lay.host, lay.nq
    # 1: X = layernorm(hs) is never formed for all T rows: the memory is projected block by block (2), and
    # the last rows (3) and the span means (4, 5) read the normalised rows of their spans only (HeadReadout)
    mem = seen.mem                                                                            # 2
    g = ops.gather_rows(seen.picked, ix.last)                                                 # 3, per question
    means = ops.span_means(ops.gather_rows(seen.picked, ix.span_rows), ix.span_starts, ix.span_ends)
    qv, ctx = means[:nq], means[nq:]                                                          # 4, 5
    lx = ops.span_means(lex, ix.lex_starts, ix.lex_ends)     # 6: the option tokens' LM-head rows, per span
    own = ix.owner
    r = (ops.linear(ctx, P["option_context_projection.weight"])                               # 7
         + ops.linear(lx, P["option_lexical_projection.weight"])
         + ops.linear(qv, P["option_question_projection.weight"])[own])
    for i in range(hc.routing_layers):                                                        # 8
        e = f"evidence_layers.{i}."
        mi = ops.layernorm(mem, P[e + "memory_norm.weight"], P[e + "memory_norm.bias"])
        r = r + _mha(ops, P, e + "attention.",
                     ops.layernorm(r, P[e + "query_norm.weight"], P[e + "query_norm.bias"]), mi, hc.heads,
                     (h.opt_seq, h.mem_seq), (ix.opt_seq, ix.mem_seq))
        y = ops.layernorm(r, P[e + "feedforward_norm.weight"], P[e + "feedforward_norm.bias"])
        r = r + ops.linear(ops.gelu(ops.linear(y, P[e + "feedforward.0.weight"], P[e + "feedforward.0.bias"])),
                           P[e + "feedforward.3.weight"], P[e + "feedforward.3.bias"])
    b = ops.linear(qv, P["question_projection.weight"])                                       # 9
    scores = xp.sum(r * b[own], axis=-1) / np.float32(math.sqrt(hc.width))                    # 10
    s = ops.segment_softmax_sum(scores, r, own, nq)
    f = (b + ops.layernorm(s, P["option_summary_norm.weight"], P["option_summary_norm.bias"])  # 11
         + ops.linear(g, P["global_projection.weight"]) + P["type_embedding.weight"][ix.types])
    for j in range(hc.layers):                                                                # 12
        d = f"layers.{j}."
        y = ops.layernorm(f, P[d + "norm1.weight"], P[d + "norm1.bias"])
        f = f + _mha(ops, P, d + "self_attn.", y, y, hc.heads, (h.q_seq, h.q_seq), (ix.q_seq, ix.q_seq))
        f = f + _mha(ops, P, d + "multihead_attn.",
                     ops.layernorm(f, P[d + "norm2.weight"], P[d + "norm2.bias"]), mem, hc.heads,
                     (h.q_seq, h.mem_seq), (ix.q_seq, ix.mem_seq))
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
    return prior + ops.sigmoid(P["residual_gate"]) * (sj * cos + res)                         # 16


def _mha(ops, P, prefix, xq, xkv, heads, groups, group_ids):
    return ops.mha(xq, xkv, P[prefix + "in_proj_weight"], P[prefix + "in_proj_bias"],
                   P[prefix + "out_proj.weight"], P[prefix + "out_proj.bias"], heads, groups, group_ids)
