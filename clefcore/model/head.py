"""The joint schema head (clef-head.md §5.3; step numbers quoted in comments): from the backbone's final-norm
states to one logit vector per question, for every sequence of a packed stream at once."""

from __future__ import annotations

import math

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
