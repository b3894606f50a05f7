"""The joint schema head (clef-head.md §5.3; step numbers quoted in comments): from the backbone's final-norm
states to one logit vector per question, for every sequence of a packed stream at once.

What the head does with a stream is fixed by its layout alone (its sequences' bounds and questions, never its
tokens or states): ``HeadLayout`` works it out on the host, every index table the head's ops read packed into one
int64 array that goes to the device in one upload.

On a backend with head graphs (CUDA) the head replays a CUDA graph (``heads``). Its
key is the stream's question schema and its token count rounded up to the graph cache's bucket, never a position:
requests of one schema whose states differ in length share a graph. For that the head runs on a padded layout,
whose launches and array shapes follow from the key alone: the stream is padded with rows that no index picks and
no attention lets through, every position (spans, sequence bounds, last rows, the attentions' groups) is data in
the index table, and no host decision reads one. The states, the option tokens' LM-head rows and the index table
are the graph's inputs, copied into its static buffers before each replay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from ..backends.interface import Backend
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

    local: Any          # per head row: its index in the slice of the stream it is picked from: its token block of
                        # the readout (HeadReadout.add), or in a padded layout the whole stream (padded_readout)
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
    mem_seq: Any        # per row of the stream: its sequence; a padded layout's pad rows: B, a group no query has


@dataclass(frozen=True)
class LayoutKey:
    """``HeadLayout.key`` of a padded layout: what fixes the head's launches and the shapes of its arrays, hashable
    and printed short (the graph cache logs it). ``block``: the readout's token block (it cuts the memory
    projection into blocks); ``tokens``: the stream's token count rounded up to the graph cache's bucket;
    ``schema``: per sequence, per question, its type index, the number of rows of its question span and of each
    of its option spans. No position is part of it: two requests of one schema whose states differ in length
    (within a bucket) have one key, their positions differing in the index table only.

    Of the schema only totals fix a shape (sequences, questions, options, span rows); a question's type, each
    span's length and which sequence asks which question are data in the table too. The key keeps the schema
    whole nonetheless, so that equal keys mean index tables equal in everything but positions (owner, types,
    span offsets): a graph serves one schema, which is what a client sends again and again."""

    block: int
    tokens: int
    schema: tuple

    def __repr__(self) -> str:
        qs = [q for seq in self.schema for q in seq]
        return (f"joint head schema ({self.tokens} padded tokens, {len(self.schema)} sequences, {len(qs)} questions, "
                f"{sum(len(q[2]) for q in qs)} options)")


class HeadLayout:
    """The joint head's work for one packed stream, from its bounds ``cu_seqlens`` and each sequence's questions
    alone; ``block``: the backend's token block (the readout's, HeadReadout.add).

    ``rows``: the head rows; ``host``: the index tables (HeadIndex of host arrays), packed into ``table`` (int64)
    and read back through ``views``.

    ``tokens`` None: the exact layout, on the stream's own rows. The head rows are ``head_rows`` and the
    attentions' key ranges are planned on the host's group ids, so its launches depend on positions; ``key`` is
    None. ``tokens`` (at least the stream's T, a multiple of the graph cache's bucket): the padded layout, over
    a stream of that many rows whose last ``tokens - T`` are padding. Its launches and every array's shape follow
    from ``key`` (LayoutKey) alone: the head rows are every span's rows, then each sequence's last row, never
    merged where they coincide (their number is the schema's), picked from the whole stream by index; the pad rows
    belong to the group B, which no question or option has; the attentions score every key and mask by the
    table's group ids. Two streams with one key therefore run the same launches on the same shapes, and the key
    names the head's CUDA graph, with the plan."""

    def __init__(self, cu_seqlens, questions_of, block: int, tokens: int | None = None):
        cu = np.asarray(cu_seqlens, dtype=np.int64)
        B = len(cu) - 1
        qs = [(b, q) for b in range(B) for q in questions_of[b]]
        self.T, self.B, self.nq = int(cu[-1]), B, len(qs)
        self.tokens = self.T if tokens is None else int(tokens)
        if self.tokens < self.T:
            raise ValueError(f"joint head: {self.tokens} padded tokens for a stream of {self.T}")
        q_seq = np.array([b for b, _ in qs], dtype=np.int64)                          # sequence of each question
        if tokens is not None and np.any(np.diff(cu)[q_seq] < 1):
            # the exact layout's attentions refuse it (cpu.check_groups); here a question without memory would
            # softmax over masked keys only
            raise ValueError("joint head: a sequence with questions has no tokens")
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
        mem_seq = np.repeat(np.arange(B), np.diff(cu))
        if tokens is None:
            self.rows = head_rows(cu, questions_of)
            blk = block or max(self.T, 1)                 # readout's blocks: [0, blk), [blk, 2 blk), ...
            local, last = self.rows % blk, np.searchsorted(self.rows, (cu[1:] - 1)[q_seq])
            picks = np.searchsorted(self.rows, span_rows)
            self.key = None
        else:
            self.rows = np.concatenate([span_rows, cu[1:] - 1]).astype(np.int64)
            local, last, picks = self.rows, len(span_rows) + q_seq, np.arange(len(span_rows))
            mem_seq = np.concatenate([mem_seq, np.full(self.tokens - self.T, B)])
            self.key = LayoutKey(int(block), self.tokens, tuple(
                tuple((int(q.type_index), _rows(q.question_span), tuple(_rows(o) for o in q.option_spans))
                      for q in questions_of[b]) for b in range(B)))
        self.host = HeadIndex(
            local=local, last=last, span_rows=picks, span_starts=span_offs[:-1], span_ends=span_offs[1:],
            lex_starts=lex_offs[:-1], lex_ends=lex_offs[1:], owner=owner,
            types=np.array([q.type_index for _, q in qs], dtype=np.int64), q_seq=q_seq, opt_seq=q_seq[owner],
            mem_seq=mem_seq)
        parts = [np.asarray(getattr(self.host, f.name), dtype=np.int64) for f in fields(HeadIndex)]
        self._bounds = np.concatenate([[0], np.cumsum([len(a) for a in parts])]).tolist()
        self.table = np.concatenate(parts)

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


def _rows(span) -> int:
    return int(span[1]) - int(span[0])


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

    def project(self, hs, t0: int) -> None:
        """The memory projection of the rows [t0, t0 + len(hs)) of the stream."""
        self.mem[t0:t0 + hs.shape[0]] = self.ops.linear(self.norm(hs), self.p.head["memory_projection.weight"])

    def add(self, hs, t0: int, local=None) -> None:
        """The rows [t0, t0 + len(hs)) of the stream. ``local``: every head row's index within its block, as the
        backend's array (HeadIndex.local), where the caller holds it; else made here."""
        ops, t1 = self.ops, t0 + hs.shape[0]
        self.project(hs, t0)
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


def padded_readout(ops: Backend, p: Params, hs, lay: HeadLayout, ix: HeadIndex) -> HeadReadout:
    """HeadReadout of a padded layout's stream hs [lay.tokens, H], its launches fixed by the layout's key: the
    pad rows zeroed first, whatever the buffer holds (they enter the memory, and an attention's masked key still
    meets its value product, where zero times a NaN is no zero), the memory projected in ``readout``'s blocks,
    then every head row picked at once from the whole stream by the table's ``local`` (how many head rows fall
    in each block is a matter of positions)."""
    hs = ops.xp.where(ix.mem_seq[:, None] < lay.B, hs, np.float32(0))
    out = HeadReadout(ops, p, lay.tokens, lay.rows)
    block = lay.key.block or lay.tokens
    for t0 in range(0, lay.tokens, block):
        out.project(hs[t0:t0 + block], t0)
    out.picked = out.norm(ops.gather_rows(hs, ix.local))
    return out


def heads(ops: Backend, p: Params, hs, ids, cu_seqlens, questions_of) -> list:
    """Joint schema head for every sequence of a packed stream in one pass. hs [T, H] final-norm states,
    ids [T] (host ints), cu_seqlens [B+1], questions_of[b]: sequence b's EncodedQuestions (spans relative to its
    start). Returns, per sequence, one logit vector (host fp32) per question.

    Where ``graph_tokens`` gives a token count, the head runs on the padded layout of that many tokens as its
    key's CUDA graph: eagerly the first time the key is seen, captured the second, replayed from then on (graphs.py's
    GraphCache, which also runs a key eagerly, logged, where its capture fails)."""
    tokens = graph_tokens(ops, int(np.asarray(cu_seqlens)[-1]))
    lay = HeadLayout(cu_seqlens, questions_of, ops.token_block, tokens)
    # the inputs: the states, the option tokens' LM-head rows (gathered from the table, wherever it lives) and
    # the index tables, each made outside any capture
    lex, table = ops.gather_rows(p.lm_head, lay.option_tokens(ids)), ops.asarray(lay.table)
    if tokens is None:
        z = _head(ops, p, lay, hs, lex, table)
    else:
        z = ops.head_graphs.run((lay.key, ops.plan), lambda *a: _head(ops, p, lay, *a),
                                (_pad_rows(ops, hs, tokens), lex, table), list(p.head.values()))
    return lay.logits(ops.to_host(z))      # the graph's output buffer is read before its next replay


def graph_tokens(ops: Backend, T: int) -> int | None:
    """Where the head's launches go, decided here only: the token count of the padded layout whose CUDA graph
    runs a stream of T tokens (T rounded up to the bucket of the backend's head graphs: CUDA's) where that count is
    within the graphs' token limit; None: the launches run from Python one by one, on the exact layout."""
    g = ops.head_graphs
    return None if g is None else g.padded_tokens(T)


def _pad_rows(ops: Backend, hs, tokens: int):
    """hs [T, H] with zero rows appended up to ``tokens`` rows (hs itself where it has that many)."""
    T = hs.shape[0]
    if T == tokens:
        return hs
    out = ops.xp.zeros((tokens, hs.shape[1]), dtype=np.float32)
    out[:T] = hs
    return out


def heads_from(ops: Backend, p: Params, seen: HeadReadout, ids, cu_seqlens, questions_of) -> list:
    """``heads`` on what a chunked prefill has read of the stream (``seen``); its launches run one by one."""
    lay = HeadLayout(cu_seqlens, questions_of, ops.token_block)
    lex = ops.gather_rows(p.lm_head, lay.option_tokens(ids))
    z = _joint(ops, p, lay, seen, lex, lay.views(ops.asarray(lay.table)))
    return lay.logits(ops.to_host(z))


def _head(ops: Backend, p: Params, lay: HeadLayout, hs, lex, table):
    """The head of a whole stream: its readout (1, 2), then ``_joint``. Everything it reads is an argument or a
    weight, and it reads nothing back to the host: what a graph captures. Of a padded layout it reads its key's
    shapes only, so that a graph captured on one layout replays any other of the same key."""
    ix = lay.views(table)
    seen = readout(ops, p, hs, lay.rows, ix.local) if lay.key is None else padded_readout(ops, p, hs, lay, ix)
    return _joint(ops, p, lay, seen, lex, ix)


def _joint(ops: Backend, p: Params, lay: HeadLayout, seen: HeadReadout, lex, ix: HeadIndex):
    """The logit of every option (the backend's array [options]) from the readout ``seen``, the option tokens'
    LM-head rows ``lex`` and the index tables ``ix`` (views of the layout's upload).

    The head's rows (options, questions) of all sequences are stacked; where it mixes rows it stays inside a
    sequence: its attentions take group ids (options and questions attend to their own sequence's memory and
    questions only), the option softmax runs per question, the last-row vector is the sequence's own. The
    attentions' key ranges are planned on the host's ids in an exact layout only (``_planned``)."""
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
                     _planned(lay, h.opt_seq, h.mem_seq), (ix.opt_seq, ix.mem_seq))
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
        f = f + _mha(ops, P, d + "self_attn.", y, y, hc.heads, _planned(lay, h.q_seq, h.q_seq),
                     (ix.q_seq, ix.q_seq))
        f = f + _mha(ops, P, d + "multihead_attn.",
                     ops.layernorm(f, P[d + "norm2.weight"], P[d + "norm2.bias"]), mem, hc.heads,
                     _planned(lay, h.q_seq, h.mem_seq), (ix.q_seq, ix.mem_seq))
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


def _planned(lay: HeadLayout, gq, gk):
    """mha's ``groups``, the host ids its key ranges are planned on: an exact layout's; None in a padded layout,
    whose attentions score every key of the stream, masked by the table's ids alone (a range planned on the ids
    would be a launch shape that moves with the positions)."""
    return (gq, gk) if lay.key is None else None
