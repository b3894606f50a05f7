"""Clef-flash, the whole model: Qwen3.5 hybrid backbone + joint schema head.

Written once against the op interface that every backend implements (``clefcore.backends.cpu`` is the
fp32 reference; ``clefcore.backends.cuda`` the GPU one). ``ops.xp`` is the backend's array module, so the
reshapes and slices below run unchanged on numpy and CuPy arrays. The math follows the specs:
backbone = qwen35-backbone.md §3, head = clef-head.md §5.3 (step numbers quoted in comments).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .checkpoint import Checkpoint
from .config import HeadConfig, TextConfig


@dataclass
class Params:
    """Backend-native weights. ``layers[i]`` maps the checkpoint's per-layer names (without ``layers.{i}.``)
    to arrays; conv weights are squeezed to [C, K]."""

    text: TextConfig
    head_config: HeadConfig
    embed: object
    norm: object
    lm_head: object
    layers: list[dict] = field(default_factory=list)
    head: dict = field(default_factory=dict)

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


def load_params(ck: Checkpoint, ops, progress=None) -> Params:
    """Convert every tensor once, in checkpoint order, into the backend's storage (``ops.weight``)."""
    names = list(ck.text_tensors) + list(ck.head_tensors)
    done = 0

    def tick(n):
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, len(names), n)

    layers = [dict() for _ in range(ck.text.num_layers)]
    p = Params(ck.text, ck.head_config, None, None, None, layers)
    for name in ck.text_tensors:
        if name in ("embed_tokens.weight", "lm_head.weight"):
            w = ops.table(ck.text_tensors[name])       # large vocab tables: the backend decides where they live
        else:
            w = ck.text_f32(name)
            if name.endswith("conv1d.weight"):
                w = w[:, 0, :]
            w = ops.weight(w)
        p.place(name, w)
        tick(name)
    for name in ck.head_tensors:
        p.head[name] = ops.weight(ck.head_f32(name))
        tick(name)
    return p


# ------------------------------------------------------------------------------------------------- backbone

def backbone(ops, p: Params, ids, cu_seqlens, positions, keep_layers: bool = False):
    """ids [T] (packed sequences), cu_seqlens [B+1], positions [T] -> (final-norm states [T, H], per-layer
    residual streams or None)."""
    c = p.text
    x = ops.embed(p.embed, ids)
    cos, sin = ops.rope_tables(positions, c.rotary_dim, c.rope_theta)
    h = ops.rmsnorm(x, p.layers[0]["input_layernorm.weight"], c.rms_eps)
    kept = [] if keep_layers else None
    for i, (kind, L) in enumerate(zip(c.layer_types, p.layers)):
        if kind == "full_attention":
            mixed = full_attention(ops, c, L, h, cu_seqlens, cos, sin)
        else:
            mixed = gated_deltanet(ops, c, L, h, cu_seqlens)
        x, h = ops.add_rmsnorm(x, mixed, L["post_attention_layernorm.weight"], c.rms_eps)
        # the residual add after the MLP is fused with the next layer's input norm (or the final norm)
        nxt = p.layers[i + 1]["input_layernorm.weight"] if i + 1 < c.num_layers else p.norm
        x, h = ops.add_rmsnorm(x, ops.mlp(h, L["mlp.gate_proj.weight"], L["mlp.up_proj.weight"],
                                          L["mlp.down_proj.weight"]), nxt, c.rms_eps)
        if kept is not None:
            kept.append(x)
    return h, kept


def full_attention(ops, c: TextConfig, L: dict, h, cu_seqlens, cos, sin):
    T, D = h.shape[0], c.head_dim
    # q_proj rows are per head [query_h ; gate_h], not [all queries ; all gates]
    qg = ops.linear(h, L["self_attn.q_proj.weight"]).reshape(T, c.num_heads, 2, D)
    q, gate = qg[:, :, 0], qg[:, :, 1]
    k = ops.linear(h, L["self_attn.k_proj.weight"]).reshape(T, c.num_kv_heads, D)
    v = ops.linear(h, L["self_attn.v_proj.weight"]).reshape(T, c.num_kv_heads, D)
    q = ops.rotary(ops.rmsnorm(q, L["self_attn.q_norm.weight"], c.rms_eps), cos, sin)
    k = ops.rotary(ops.rmsnorm(k, L["self_attn.k_norm.weight"], c.rms_eps), cos, sin)
    o = ops.attention(q, k, v, cu_seqlens, 1.0 / math.sqrt(D))
    o = ops.sigmoid_gate(o, gate)
    return ops.linear(o.reshape(T, c.num_heads * D), L["self_attn.o_proj.weight"])


def gated_deltanet(ops, c: TextConfig, L: dict, h, cu_seqlens):
    T = h.shape[0]
    hk, dk, hv, dv = c.lin_k_heads, c.lin_k_dim, c.lin_v_heads, c.lin_v_dim
    kd = hk * dk
    mixed = ops.conv1d_silu(ops.linear(h, L["linear_attn.in_proj_qkv.weight"]),
                            L["linear_attn.conv1d.weight"], cu_seqlens)
    q = ops.l2norm(mixed[:, :kd].reshape(T, hk, dk), 1e-6, 1.0 / math.sqrt(dk))
    k = ops.l2norm(mixed[:, kd:2 * kd].reshape(T, hk, dk), 1e-6)
    v = mixed[:, 2 * kd:].reshape(T, hv, dv)
    g, beta = ops.gdn_gates(ops.linear(h, L["linear_attn.in_proj_a.weight"]),
                            ops.linear(h, L["linear_attn.in_proj_b.weight"]),
                            L["linear_attn.A_log"], L["linear_attn.dt_bias"])
    o = ops.gated_delta_rule(q, k, v, g, beta, cu_seqlens)
    z = ops.linear(h, L["linear_attn.in_proj_z.weight"])
    y = ops.gated_rmsnorm(o.reshape(T * hv, dv), z.reshape(T * hv, dv), L["linear_attn.norm.weight"], c.rms_eps)
    return ops.linear(y.reshape(T, hv * dv), L["linear_attn.out_proj.weight"])


# ----------------------------------------------------------------------------------------------------- head

def head(ops, p: Params, hs, ids, questions) -> list:
    """Joint schema head for ONE sequence. hs [L, H] final-norm states, ids [L] (host ints),
    questions: EncodedQuestion sequence. Returns one logit vector (host fp32) per question."""
    xp, P, hc = ops.xp, p.head, p.head_config
    nq = len(questions)
    owner = np.concatenate([np.full(len(q.option_spans), i) for i, q in enumerate(questions)])
    o_starts = np.array([s for q in questions for s, _ in q.option_spans])
    o_ends = np.array([e for q in questions for _, e in q.option_spans])
    types = np.array([q.type_index for q in questions])

    X = ops.layernorm(hs, P["hidden_norm.weight"], P["hidden_norm.bias"])                  # 1
    mem = ops.linear(X, P["memory_projection.weight"])                                        # 2
    g = X[-1:]                                                                                # 3
    qv = ops.span_means(X, [q.question_span[0] for q in questions],
                        [q.question_span[1] for q in questions])                              # 4
    ctx = ops.span_means(X, o_starts, o_ends)                                                 # 5
    # 6: LM-head rows of the option tokens, gathered once, then averaged per span
    tok = np.concatenate([ids[s:e] for s, e in zip(o_starts, o_ends)])
    lens = o_ends - o_starts
    offs = np.concatenate([[0], np.cumsum(lens)])
    lx = ops.span_means(ops.gather_rows(p.lm_head, tok), offs[:-1], offs[1:])
    own = xp.asarray(owner)
    r = (ops.linear(ctx, P["option_context_projection.weight"])                               # 7
         + ops.linear(lx, P["option_lexical_projection.weight"])
         + ops.linear(qv, P["option_question_projection.weight"])[own])
    for i in range(hc.routing_layers):                                                        # 8
        e = f"evidence_layers.{i}."
        mi = ops.layernorm(mem, P[e + "memory_norm.weight"], P[e + "memory_norm.bias"])
        r = r + _mha(ops, P, e + "attention.",
                     ops.layernorm(r, P[e + "query_norm.weight"], P[e + "query_norm.bias"]), mi, hc.heads)
        y = ops.layernorm(r, P[e + "feedforward_norm.weight"], P[e + "feedforward_norm.bias"])
        r = r + ops.linear(ops.gelu(ops.linear(y, P[e + "feedforward.0.weight"], P[e + "feedforward.0.bias"])),
                           P[e + "feedforward.3.weight"], P[e + "feedforward.3.bias"])
    b = ops.linear(qv, P["question_projection.weight"])                                       # 9
    scores = xp.sum(r * b[own], axis=-1) / np.float32(math.sqrt(hc.width))                    # 10
    s = ops.segment_softmax_sum(scores, r, own, nq)
    f = (b + ops.layernorm(s, P["option_summary_norm.weight"], P["option_summary_norm.bias"])  # 11
         + ops.linear(g, P["global_projection.weight"]) + P["type_embedding.weight"][xp.asarray(types)])
    for j in range(hc.layers):                                                                # 12
        d = f"layers.{j}."
        y = ops.layernorm(f, P[d + "norm1.weight"], P[d + "norm1.bias"])
        f = f + _mha(ops, P, d + "self_attn.", y, y, hc.heads)
        f = f + _mha(ops, P, d + "multihead_attn.",
                     ops.layernorm(f, P[d + "norm2.weight"], P[d + "norm2.bias"]), mem, hc.heads)
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
    return [z[owner == i] for i in range(nq)]


def _mha(ops, P, prefix, xq, xkv, heads):
    return ops.mha(xq, xkv, P[prefix + "in_proj_weight"], P[prefix + "in_proj_bias"],
                   P[prefix + "out_proj.weight"], P[prefix + "out_proj.bias"], heads)
