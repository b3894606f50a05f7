"""The vision tower (Qwen3.5: Qwen3-VL's without deepstack), written once against the backend interface like
the backbone and the head (clef-images.md §8): patch embedding, bilinearly resampled learned positions, 2-D RoPE,
bidirectional per-image attention in LayerNorm / GELU-tanh blocks, and the 2x2 merger to the text width.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field, replace

import numpy as np

from ..backends.interface import Backend
from ..checkpoint import Checkpoint, to_float32
from ..config import read_json
from ..errors import CheckpointError

log = logging.getLogger("clefcore")

PREFIX = "model.visual."
LN_EPS = 1e-6


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    depth: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    num_position_embeddings: int
    out_hidden_size: int
    in_channels: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def side(self) -> int:
        """The learned position table is a side x side grid."""
        return math.isqrt(self.num_position_embeddings)

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "VisionConfig":
        try:
            cfg = cls(**{k: int(d[k]) for k in (
                "hidden_size", "intermediate_size", "depth", "num_heads", "patch_size", "temporal_patch_size",
                "spatial_merge_size", "num_position_embeddings", "out_hidden_size", "in_channels")})
        except KeyError as e:
            raise CheckpointError(f"{source}: missing vision_config field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: malformed vision_config value ({e})") from None
        if cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4:
            raise CheckpointError(f"{source}: vision head dim {cfg.hidden_size}/{cfg.num_heads} must be a multiple "
                                  f"of 4 (2-D RoPE)")
        if cfg.side * cfg.side != cfg.num_position_embeddings:
            raise CheckpointError(f"{source}: num_position_embeddings {cfg.num_position_embeddings} is not a square")
        if (cfg.patch_size, cfg.temporal_patch_size, cfg.spatial_merge_size, cfg.in_channels) != (16, 2, 2, 3):
            # the preprocessing (clefcore/preprocess.py) is written for these, as the release's processor is
            raise CheckpointError(f"{source}: vision patch {cfg.patch_size}, temporal {cfg.temporal_patch_size}, "
                                  f"merge {cfg.spatial_merge_size}, channels {cfg.in_channels}: only 16, 2, 2, 3")
        return cfg


@dataclass
class VisionParams:
    config: VisionConfig
    w: dict = field(default_factory=dict)   # names without "model.visual."; patch_embed.proj.weight as [hidden, 1536]


def has_vision(ck: Checkpoint) -> bool:
    return "vision_config" in read_json(ck.path / "config.json")


def mrope_section(ck: Checkpoint) -> tuple[int, int, int] | None:
    """The text config's interleaved M-RoPE section (T, H, W frequencies), or None when the checkpoint has none or
    a layout that model.rope does not implement (non-interleaved sections)."""
    tc = read_json(ck.path / "config.json").get("text_config") or {}
    rope = tc.get("rope_parameters") or {}
    section = rope.get("mrope_section")
    if not rope.get("mrope_interleaved") or not isinstance(section, list) or len(section) != 3:
        return None
    return tuple(int(v) for v in section)


def attach(ck: Checkpoint, ops, params, progress=None) -> tuple[VisionParams | None, str | None]:
    """Load the tower for a backbone already loaded into ``params`` (which then gets the M-RoPE section):
    (vision params, None), or (None, the message an image request gets) when this checkpoint cannot answer images.
    An incomplete tower (synthetic checkpoints carry a stub) leaves text exact: it is refused, not fatal."""
    if not has_vision(ck):
        return None, "images: this model has no vision tower"
    section = mrope_section(ck)
    if section is None:
        return None, "images: this model's M-RoPE layout is not supported (interleaved mrope_section expected)"
    try:
        vp = load_vision(ck, ops, progress)
    except CheckpointError as e:
        log.warning("vision tower not loaded, image requests are refused: %s", e.message)
        return None, "images: this model's vision tower is incomplete"
    params.mrope_section = section
    return vp, None


def load_vision(ck: Checkpoint, ops, progress=None) -> VisionParams:
    """``model.visual.*`` from the checkpoint's shards into backend storage (CheckpointError naming a missing or
    misshapen tensor). Matrices go through ``ops.weight`` like the backbone's (on the GPU: fp16, with the
    precision modes' paths)."""
    config_path = ck.path / "config.json"
    cfg = VisionConfig.from_dict(read_json(config_path).get("vision_config") or {}, str(config_path))
    refs = ck.shard_tensors(PREFIX)
    expected = expected_vision_shapes(cfg)
    missing = [n for n in expected if n not in refs]
    if missing:
        raise CheckpointError(f"{ck.path}: vision tower tensors missing: {[PREFIX + n for n in missing[:5]]}")
    p = VisionParams(cfg)
    for i, (name, shape) in enumerate(expected.items()):
        ref = refs[name]
        if tuple(ref.shape) != shape:
            raise CheckpointError(f"{ref.file}: {PREFIX + name} has shape {list(ref.shape)}, expected {list(shape)}")
        if name == "patch_embed.proj.weight":
            # Conv3d with kernel = stride: a matmul over 1536 inputs, stored as that matrix (so a GPU keeps it fp16)
            raw = ref.raw.reshape(cfg.hidden_size, -1)
            ref = replace(ref, shape=raw.shape, raw=raw)
        if name == "pos_embed.weight":
            # rows gathered and blended per patch, never a GEMM operand: fp32 on every backend
            p.w[name] = ops.asarray(to_float32(ref))
        else:
            p.w[name] = ops.weight(ref)
        if progress is not None:
            progress(i + 1, len(expected), PREFIX + name)
    return p


def expected_vision_shapes(c: VisionConfig) -> dict[str, tuple[int, ...]]:
    H, I, m2 = c.hidden_size, c.intermediate_size, c.hidden_size * c.spatial_merge_size ** 2
    out = {"patch_embed.proj.weight": (H, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size),
           "patch_embed.proj.bias": (H,), "pos_embed.weight": (c.num_position_embeddings, H)}
    for j in range(c.depth):
        b = f"blocks.{j}."
        out.update({b + "norm1.weight": (H,), b + "norm1.bias": (H,), b + "norm2.weight": (H,), b + "norm2.bias": (H,),
                    b + "attn.qkv.weight": (3 * H, H), b + "attn.qkv.bias": (3 * H,),
                    b + "attn.proj.weight": (H, H), b + "attn.proj.bias": (H,),
                    b + "mlp.linear_fc1.weight": (I, H), b + "mlp.linear_fc1.bias": (I,),
                    b + "mlp.linear_fc2.weight": (H, I), b + "mlp.linear_fc2.bias": (H,)})
    out.update({"merger.norm.weight": (H,), "merger.norm.bias": (H,),
                "merger.linear_fc1.weight": (m2, m2), "merger.linear_fc1.bias": (m2,),
                "merger.linear_fc2.weight": (c.out_hidden_size, m2), "merger.linear_fc2.bias": (c.out_hidden_size,)})
    return out


# ----------------------------------------------------------------------------------------- host-side tables

def _block_order(a: np.ndarray, m: int) -> np.ndarray:
    """[h, w, ...] in raster order -> [h*w, ...] in merge-block order (block row, block col, row, col)."""
    h, w = a.shape[:2]
    a = a.reshape((h // m, m, w // m, m) + a.shape[2:]).swapaxes(1, 2)
    return a.reshape((h * w,) + a.shape[4:])


def position_weights(c: VisionConfig, gh: int, gw: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear resampling of the side x side table to gh x gw (align_corners=True), in fp32 as transformers:
    (table rows [gh*gw, 4], weights [gh*gw, 4]) in merge-block order."""
    def axis(n):
        x = np.linspace(0, c.side - 1, n, dtype=np.float32) if n > 1 else np.zeros(1, np.float32)
        lo = x.astype(np.int64)
        hi = np.minimum(lo + 1, c.side - 1)
        return lo, hi, (x - lo.astype(np.float32)).astype(np.float32)
    h0, h1, dh = axis(gh)
    w0, w1, dw = axis(gw)
    one = np.float32(1)
    rows = np.stack([h0[:, None] * c.side + w0, h0[:, None] * c.side + w1,
                     h1[:, None] * c.side + w0, h1[:, None] * c.side + w1], axis=-1)
    weights = np.stack([(one - dh)[:, None] * (one - dw), (one - dh)[:, None] * dw,
                        dh[:, None] * (one - dw), dh[:, None] * dw], axis=-1)
    m = c.spatial_merge_size
    return _block_order(rows, m), _block_order(weights.astype(np.float32), m)


def rotary_angles(c: VisionConfig, gh: int, gw: int) -> np.ndarray:
    """2-D RoPE angles [gh*gw, head_dim/2] = [row*f, col*f] per patch (row, column of the patch, not of the merged
    token), inv_freq = 1/10000^(arange(0, hd/2, 2)/(hd/2)), fp32, merge-block order."""
    half = c.head_dim // 2
    inv = np.float32(1.0) / (np.float32(10000.0) ** (np.arange(0, half, 2, dtype=np.float32) / np.float32(half)))
    rc = np.stack(np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij"), axis=-1)     # [gh, gw, 2]
    rc = _block_order(rc, c.spatial_merge_size).astype(np.float32)
    return (rc[:, :, None] * inv[None, None, :]).reshape(len(rc), half).astype(np.float32)


# ---------------------------------------------------------------------------------------------------- tower

def tower(ops: Backend, p: VisionParams, pixel_values, grids, keep: dict | None = None, replay: bool = True):
    """pixel_values [N, 1536] (the images' patch rows, concatenated: ``ops.patch_rows``, or a fixture's), grids
    [(t, gh, gw)] per image -> image embeddings [N / 4, out_hidden] in placeholder order. ``keep`` (a dict)
    receives the intermediate stages, for checks. ``replay=False`` runs it without graphs (synthetic images,
    such as the server's measurement at start, must not take a place among them).

    A backend with ``ops.tower_graphs`` (CUDA; None on the CPU) replays one graph per set of image sizes while
    their merged tokens stay within its token limit (a 1024 x 1024 image's 1,024 at the default): the tower is
    ~500 short launches, which the host issues more slowly than the GPU runs them. The host tables are made here,
    outside the graph, and go in as its inputs; the output is copied, since the graph's buffer is rewritten by its
    next replay."""
    grids = tuple(tuple(int(v) for v in g) for g in grids)              # a key of the graph and table caches
    sizes = [t * gh * gw for t, gh, gw in grids]
    cu = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)      # each image attends only to itself
    inputs = (ops.asarray(pixel_values),) + tuple(ops.asarray(a) for a in _host_tables(p.config, grids))
    graphs = ops.tower_graphs
    merged = int(cu[-1]) // p.config.spatial_merge_size ** 2
    # where the plan's row allows it (fast): the exact modes' fp32 vision attention calls CuPy's cuBLAS matmul,
    # which refuses a capture
    if keep is not None or not replay or graphs is None or not ops.plan.row.tower_graphs or not graphs.fits(merged):
        return _tower(ops, p, cu, keep, *inputs)
    key = ("vision tower", grids, ops.plan)
    return graphs.run(key, lambda *a: _tower(ops, p, cu, None, *a), inputs, list(p.w.values())).copy()


@functools.lru_cache(maxsize=8)
def _host_tables(c: VisionConfig, grids: tuple) -> tuple:
    """The host-made tables of a set of images (``grids``: int tuples): the position table's rows and bilinear
    weights [N, 4] each, and the 2-D RoPE's cos and sin [N, head_dim / 2]. Read-only, kept for the last few sets
    of image sizes: about 2 ms of numpy for one 1024 x 1024 image, while the GPU waits for the tower, and a service
    sees the same sizes again and again."""
    rows, weights, angles = [], [], []
    for t, gh, gw in grids:
        r, wt = position_weights(c, gh, gw)
        rows += [r] * t
        weights += [wt] * t
        angles += [rotary_angles(c, gh, gw)] * t
    ang = np.concatenate(angles)
    out = (np.concatenate(rows), np.concatenate(weights), np.cos(ang), np.sin(ang))
    for a in out:
        a.flags.writeable = False
    return out


def _tower(ops, p: VisionParams, cu, keep, pixel_values, rows, weights, cos, sin):
    c, w = p.config, p.w
    x = ops.linear(pixel_values, w["patch_embed.proj.weight"], w["patch_embed.proj.bias"])
    table = w["pos_embed.weight"]
    pos = ops.gather_rows(table, rows[:, 0]) * weights[:, 0:1]
    for k in range(1, 4):
        pos = pos + ops.gather_rows(table, rows[:, k]) * weights[:, k:k + 1]
    if keep is not None:
        keep["patch_embeds"], keep["pos_embeds"], keep["blocks"] = x, pos, []
    x = x + pos
    n = x.shape[0]
    # the MLP runs over row blocks of the backend's token_block (0: all rows, the CPU), so its [rows, intermediate]
    # activations stay bounded when the images of a batch have tens of thousands of patches
    step = ops.token_block or max(n, 1)
    for j in range(c.depth):
        b = f"blocks.{j}."
        h = ops.layernorm(x, w[b + "norm1.weight"], w[b + "norm1.bias"], LN_EPS)
        x = x + ops.vision_attention(h, w[b + "attn.qkv.weight"], w[b + "attn.qkv.bias"], w[b + "attn.proj.weight"],
                                     w[b + "attn.proj.bias"], c.num_heads, cos, sin, cu)
        del h
        for r0 in range(0, n, step):
            xb = x[r0:r0 + step]                                   # a view: the residual add lands in x
            h = ops.layernorm(xb, w[b + "norm2.weight"], w[b + "norm2.bias"], LN_EPS)
            xb += ops.vision_mlp(h, w[b + "mlp.linear_fc1.weight"], w[b + "mlp.linear_fc1.bias"],
                                 w[b + "mlp.linear_fc2.weight"], w[b + "mlp.linear_fc2.bias"])
            del h
        ops.watch(x, f"vision block {j} output")
        if keep is not None:
            keep["blocks"].append(x.copy())
    m2 = c.spatial_merge_size ** 2
    h = ops.layernorm(x, w["merger.norm.weight"], w["merger.norm.bias"], LN_EPS).reshape(n // m2, m2 * c.hidden_size)
    h = ops.gelu(ops.linear(h, w["merger.linear_fc1.weight"], w["merger.linear_fc1.bias"]))     # erf GELU here
    out = ops.linear(h, w["merger.linear_fc2.weight"], w["merger.linear_fc2.bias"])
    ops.watch(out, "vision merger output")
    return out
