"""Random weights made on the GPU for ``clefcore bench`` without ``--model``: the backbone and joint head at a
preset's shapes, and a vision tower. Each tensor is drawn by clefcore.random_weights' rules, the ones ``clefcore
synth`` writes checkpoints by, and stored as loading such a checkpoint would store it (``ops.weight``: matrices
fp16 with split8's fp8 twin, the rest fp32; vocabulary tables as bf16 on the device), without the minutes of
writing and reading ~19 GB."""

from __future__ import annotations

import numpy as np

from ..random_weights import draw, kind_of


def _store(cp, ops, values):
    """Drawn values as ops.weight stores a checkpoint tensor: a matrix (both dims >= 16) fp16 with its fp8
    twin where split8 runs, anything else fp32."""
    if values.ndim == 2 and min(values.shape) >= 16:
        return ops.twin(values.astype(cp.float16))
    return values.astype(cp.float32, copy=False)


def random_params(cp, ops, text_cfg, head_cfg):
    """Backbone and joint head at ``text_cfg`` / ``head_cfg``'s shapes, FUSED groups stacked as load_params
    stacks them, conv taps squeezed to [C, K]."""
    from ..backends.cuda.ops import DeviceTable
    from ..checkpoint import expected_head_shapes, expected_text_shapes
    from ..model.params import Params, stored_groups
    rs = cp.random.RandomState(0)
    layers = [dict() for _ in range(text_cfg.num_layers)]
    p = Params(text_cfg, head_cfg, None, None, None, layers)
    shapes = expected_text_shapes(text_cfg)
    for name, parts in stored_groups(shapes):
        shape = (sum(shapes[n][0] for n in parts),) + tuple(shapes[parts[0]][1:])   # FUSED parts stacked
        kind = kind_of(name, True)
        if name in ("embed_tokens.weight", "lm_head.weight"):
            bits = draw(rs, kind, shape).astype(cp.float32, copy=False).view(cp.uint32) >> 16
            w = DeviceTable(bits.astype(cp.uint16), shape)
        elif name.endswith("conv1d.weight"):
            w = _store(cp, ops, draw(rs, kind, (shape[0], shape[2])))
        else:
            w = _store(cp, ops, draw(rs, kind, shape))
        p.place(name, w)
    for name, shape in expected_head_shapes(head_cfg).items():
        p.head[name] = _store(cp, ops, draw(rs, kind_of(name, False), shape))
    return p


def random_vision_params(cp, ops, cfg):
    """A tower at ``cfg``'s shapes, stored as vision.load_vision stores one: the patch embedding as its
    [hidden, 1536] matrix, the position table fp32."""
    from ..model.vision import VisionParams, expected_vision_shapes
    rs = cp.random.RandomState(1)
    p = VisionParams(cfg)
    for name, shape in expected_vision_shapes(cfg).items():
        kind = kind_of(name, False)
        if name == "patch_embed.proj.weight":
            p.w[name] = _store(cp, ops, draw(rs, kind, (shape[0], int(np.prod(shape[1:])))))
        elif name == "pos_embed.weight":
            p.w[name] = draw(rs, kind, shape).astype(cp.float32, copy=False)
        else:
            p.w[name] = _store(cp, ops, draw(rs, kind, shape))
    return p
