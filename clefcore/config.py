"""Model configuration: the backbone's ``text_config`` and the joint head's ``joint_head_config.json``.

Only the fields the text prefill needs are kept; every derived size is checked against the others so a
mistyped config fails at load with the file and the values named, not later as a shape error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError


@dataclass(frozen=True)
class TextConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    layer_types: tuple[str, ...]          # "linear_attention" | "full_attention" per layer
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    lin_k_heads: int
    lin_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    conv_kernel: int
    rms_eps: float
    vocab_size: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.lin_k_heads * self.lin_k_dim + self.lin_v_heads * self.lin_v_dim

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "TextConfig":
        tc = d.get("text_config", d)  # VLM form nests the text model; a plain text config is accepted too
        try:
            n = int(tc["num_hidden_layers"])
            types = tc.get("layer_types")
            if types is None:
                every = int(tc.get("full_attention_interval", 4))
                types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
            rope = tc.get("rope_parameters") or {}
            theta = float(rope.get("rope_theta", tc.get("rope_theta", 10000.0)))
            partial = float(rope.get("partial_rotary_factor", tc.get("partial_rotary_factor", 1.0)))
            head_dim = int(tc.get("head_dim") or tc["hidden_size"] // tc["num_attention_heads"])
            cfg = cls(
                hidden_size=int(tc["hidden_size"]),
                intermediate_size=int(tc["intermediate_size"]),
                num_layers=n,
                layer_types=tuple(types),
                num_heads=int(tc["num_attention_heads"]),
                num_kv_heads=int(tc["num_key_value_heads"]),
                head_dim=head_dim,
                rotary_dim=int(head_dim * partial),
                rope_theta=theta,
                lin_k_heads=int(tc["linear_num_key_heads"]),
                lin_v_heads=int(tc["linear_num_value_heads"]),
                lin_k_dim=int(tc["linear_key_head_dim"]),
                lin_v_dim=int(tc["linear_value_head_dim"]),
                conv_kernel=int(tc["linear_conv_kernel_dim"]),
                rms_eps=float(tc["rms_norm_eps"]),
                vocab_size=int(tc["vocab_size"]),
            )
        except KeyError as e:
            raise CheckpointError(f"{source}: missing text_config field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: malformed text_config value ({e})") from None
        cfg.check(source)
        return cfg

    def check(self, source: str) -> None:
        problems = []
        if len(self.layer_types) != self.num_layers:
            problems.append(f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is {self.num_layers}")
        bad = sorted(set(self.layer_types) - {"linear_attention", "full_attention"})
        if bad:
            problems.append(f"unknown layer types {bad}")
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            problems.append(f"num_attention_heads {self.num_heads} is not a multiple of "
                            f"num_key_value_heads {self.num_kv_heads}")
        if self.lin_k_heads <= 0 or self.lin_v_heads % self.lin_k_heads:
            problems.append(f"linear_num_value_heads {self.lin_v_heads} is not a multiple of "
                            f"linear_num_key_heads {self.lin_k_heads}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            problems.append(f"rotary dim {self.rotary_dim} must be even and within head_dim {self.head_dim}")
        if self.conv_kernel < 1:
            problems.append(f"linear_conv_kernel_dim {self.conv_kernel} < 1")
        if problems:
            raise CheckpointError(f"{source}: inconsistent config: " + "; ".join(problems))


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    width: int
    routing_layers: int
    layers: int
    heads: int
    feedforward: int

    @classmethod
    def from_dict(cls, d: dict, source: str = "joint_head_config.json") -> "HeadConfig":
        try:
            cfg = cls(**{k: int(d[k]) for k in
                         ("hidden_size", "width", "routing_layers", "layers", "heads", "feedforward")})
        except KeyError as e:
            raise CheckpointError(f"{source}: missing field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: malformed value ({e})") from None
        if cfg.heads <= 0 or cfg.width % cfg.heads:
            raise CheckpointError(f"{source}: width {cfg.width} is not a multiple of heads {cfg.heads}")
        return cfg


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read JSON ({e})") from None
