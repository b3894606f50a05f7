"""The one set of rules a random-weight model is drawn by: each tensor's kind, from its name, and the values of
each kind. ``clefcore synth`` draws with them on the host (numpy, one generator per tensor, so the files are
deterministic) and ``clefcore bench`` on the GPU (CuPy, the same rules without the write and the read), so that
both make the same kind of model: the scales that keep a deep random model's activations in range (what
``clefcore verify`` passes on at clef-flash's shapes) and the values the code treats specially (zero-centred
norms, logit scales above the clamp).
"""

from __future__ import annotations

import numpy as np

# (the kinds) zero-centred norm weights (used as 1 + w), plain norm weights, biases, the GDN's A_log, head scalars,
# conv taps, and matrices (everything else, N(0, 1 / fan_in))
KINDS = ("zc_norm", "norm", "bias", "a_log", "scalar", "conv", "matrix")


def kind_of(name: str, zero_centred: bool) -> str:
    """The kind of the tensor ``name`` (its checkpoint name below the model's prefix, e.g.
    ``layers.0.input_layernorm.weight``); ``zero_centred``: the model's RMSNorms store w and use 1 + w (the
    backbone's) rather than w (the head's and the vision tower's LayerNorms)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log":
        return "a_log"
    if name.endswith("conv1d.weight"):
        return "conv"
    if name in ("prior_logit_scale", "joint_logit_scale", "residual_gate"):
        return "scalar"
    if leaf in ("bias", "dt_bias", "in_proj_bias"):
        return "bias"
    if "norm" in name and leaf == "weight":
        # every backbone RMSNorm is zero-centred except the gated one inside the GDN mixer
        return "zc_norm" if zero_centred and not name.endswith("linear_attn.norm.weight") else "norm"
    return "matrix"


def draw(rng, kind: str, shape: tuple):
    """Values of ``kind`` for a tensor of ``shape`` from ``rng`` (a numpy Generator or a CuPy RandomState: the
    calls below are common to both), as the generator returns them (float64, or float32 for matrices); the
    caller converts them to what it stores. A matrix's fan-in is the product of its trailing dimensions (the
    vision tower's patch embedding: 1536), a vector's its length."""
    if kind == "zc_norm":
        return rng.uniform(-0.3, 0.3, shape)
    if kind == "norm":
        return rng.uniform(0.7, 1.3, shape)
    if kind == "bias":
        return rng.uniform(-0.1, 0.1, shape)
    if kind == "a_log":
        return rng.uniform(-1.0, 1.5, shape)
    if kind == "scalar":                     # one value for the whole tensor, sometimes above ln(100): the clamp
        return rng.uniform(1.0, 5.0, (1,)).repeat(int(np.prod(shape, dtype=np.int64))).reshape(shape)
    if kind == "conv":
        return rng.normal(0.0, 0.3, shape)
    if kind != "matrix":
        raise ValueError(f"random weight kind {kind!r}: expected one of {', '.join(KINDS)}")
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[-1]
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(1.0 / np.sqrt(fan_in))
