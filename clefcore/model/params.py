"""The model's weights: every checkpoint tensor converted once into the backend's storage (``Params``), the
projections that read the same input stacked into one (``FUSED``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..checkpoint import Checkpoint, stack_refs
from ..config import HeadConfig, TextConfig


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
