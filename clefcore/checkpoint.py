"""Checkpoint directory in the Cloudflare/clef-flash release layout.

Each ``*.safetensors`` file is memory-mapped once; tensors are views into the map until a backend asks for
them in its own dtype. bf16 is widened to fp32 by exact bit shifting (numpy has no bf16). The text-only
engine never touches ``model.visual.*`` or ``mtp.*``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import hub
from .config import HeadConfig, TextConfig, read_json
from .errors import CheckpointError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"              # the backbone in one file, without an index
# Every file of the release layout clefcore reads, but the backbone's weights (INDEX and the shards it names,
# or SINGLE)
READ_FILES = ("config.json", "joint_head_config.json", "tokenizer.json", "joint_head.safetensors")
# What `clefcore download` fetches of a release: what clefcore reads and the tokenizer's settings beside it
RELEASE_FILES = (*READ_FILES, INDEX, "model-*.safetensors", SINGLE, "tokenizer_config.json")
TEXT_PREFIX = "model.language_model."
SKIPPED_PREFIXES = ("model.visual.", "mtp.")
_DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorRef:
    file: Path
    name: str
    dtype: str           # safetensors dtype tag
    shape: tuple[int, ...]
    raw: np.ndarray      # view into the file's memory map, dtype per _DTYPES


class SafetensorsFile:
    """One memory-mapped safetensors file."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) != 8:
                    raise CheckpointError(f"{path}: truncated safetensors header")
                (n,) = struct.unpack("<Q", head)
                if n > _MAX_HEADER:
                    raise CheckpointError(f"{path}: header of {n} bytes is implausible")
                header = json.loads(f.read(n))
            self._map = np.memmap(path, dtype=np.uint8, mode="r")
        except OSError as e:
            raise CheckpointError(f"{path}: cannot open ({e})") from None
        except ValueError as e:
            raise CheckpointError(f"{path}: malformed safetensors header ({e})") from None
        self.metadata = header.pop("__metadata__", None)
        self.entries = header
        self._base = 8 + n

    def names(self) -> list[str]:
        return list(self.entries)

    def ref(self, name: str) -> TensorRef:
        e = self.entries[name]
        tag, shape = e["dtype"], tuple(e["shape"])
        if tag not in _DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name} has unsupported dtype {tag} "
                                  f"(supported: {', '.join(_DTYPES)})")
        start, end = e["data_offsets"]
        dt = np.dtype(_DTYPES[tag])
        count = int(np.prod(shape, dtype=np.int64))
        if end - start != count * dt.itemsize or self._base + end > self._map.size:
            raise CheckpointError(f"{self.path}: tensor {name} byte range {start}..{end} does not match "
                                  f"shape {list(shape)} of {tag} or the file size {self._map.size}")
        raw = self._map[self._base + start:self._base + end].view(dt).reshape(shape)
        return TensorRef(self.path, name, tag, shape, raw)


def stack_refs(name: str, refs: list[TensorRef]) -> TensorRef:
    """Tensors with equal column counts as one, rows concatenated (a fused projection, model.params.FUSED), in their
    common dtype (fp32 when they differ); a single ref is returned as it is."""
    if len(refs) == 1:
        return refs[0]
    if len({r.dtype for r in refs}) == 1:
        raw = np.concatenate([r.raw for r in refs])
    else:
        raw = np.concatenate([to_float32(r) for r in refs])
    tag = refs[0].dtype if raw.dtype == refs[0].raw.dtype else "F32"
    return TensorRef(refs[0].file, name, tag, tuple(raw.shape), raw)


def to_float32(ref: TensorRef, rows=None) -> np.ndarray:
    """Exact widening to a fresh fp32 array (bf16 is the top half of an fp32 bit pattern), of the whole tensor
    or of the given rows only."""
    raw = ref.raw if rows is None else ref.raw[np.asarray(rows)]
    if ref.dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return np.array(raw, dtype=np.float32)  # a copy: never a view into the read-only map


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit patterns, round to nearest even (for writing checkpoints)."""
    x = np.asarray(x, dtype=np.float32)
    u = np.ascontiguousarray(x).view(np.uint32).reshape(x.shape)
    rounded = u + 0x7FFF + ((u >> 16) & 1)
    return np.where(np.isnan(x), np.uint16(0x7FC0), (rounded >> 16).astype(np.uint16))


def write_safetensors(path: Path, tensors: dict) -> int:
    """Write ``{name: (dtype_tag, shape, make)}`` where ``make()`` returns the array in the tag's element type.

    Tensors are produced and written one at a time, so a shard never has to fit in memory. Returns bytes written.
    """
    header, offset = {}, 0
    for name, (tag, shape, _) in tensors.items():
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[tag]).itemsize
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, (tag, shape, make) in tensors.items():
            arr = np.asarray(make(), dtype=_DTYPES[tag])
            if arr.shape != tuple(shape):
                raise ValueError(f"{name}: made shape {arr.shape}, declared {tuple(shape)}")
            f.write(arr.tobytes())
    return offset


class Checkpoint:
    """A model directory: configs, tokenizer path, and every text/head tensor by name.

    Text tensor names are stored without the ``model.language_model.`` prefix (``layers.0.mlp.up_proj.weight``,
    ``embed_tokens.weight``, ``norm.weight``); ``lm_head.weight`` keeps its name.
    """

    def __init__(self, model: str | Path, revision: str | None = None):
        """``model``: a directory, or a Hub id found in the Hugging Face cache at ``revision`` (clefcore/hub.py)."""
        self.where = hub.locate(model, revision)
        self.path = self.where.path
        self.name = self.where.name
        missing = missing_files(self.path)
        if missing:
            raise CheckpointError(f"{self.path / missing[0]}: file not found"
                                  + (f" (nor {', '.join(missing[1:])})" if missing[1:] else "")
                                  + (f"; {self.where.incomplete}" if self.where.incomplete else ""))
        self.text = TextConfig.from_dict(read_json(self.path / "config.json"), str(self.path / "config.json"))
        self.head_config = HeadConfig.from_dict(read_json(self.path / "joint_head_config.json"),
                                                str(self.path / "joint_head_config.json"))
        self.tokenizer_path = self.path / "tokenizer.json"
        if not self.tokenizer_path.is_file():
            raise CheckpointError(f"{self.tokenizer_path}: file not found")
        self.files: dict[Path, SafetensorsFile] = {}
        self.text_tensors = self._text_refs()
        self.head_tensors = self._refs(self.path / "joint_head.safetensors", lambda n: n)
        if self.text.hidden_size != self.head_config.hidden_size:
            raise CheckpointError(f"{self.path}: config.json hidden_size {self.text.hidden_size} != "
                                  f"joint_head_config.json hidden_size {self.head_config.hidden_size}")
        check_shapes(self)

    def _open(self, path: Path) -> SafetensorsFile:
        if path not in self.files:  # each shard is mapped exactly once
            if not path.is_file():
                raise CheckpointError(f"{path}: file not found")
            self.files[path] = SafetensorsFile(path)
        return self.files[path]

    def _refs(self, path: Path, rename) -> dict[str, TensorRef]:
        f = self._open(path)
        out = {}
        for name in f.names():
            short = rename(name)
            if short is not None:
                out[short] = f.ref(name)
        return out

    def _text_refs(self) -> dict[str, TensorRef]:
        index = self.path / INDEX
        if index.is_file():
            weight_map = _weight_map(index)
            shards = sorted(set(weight_map.values()))
        else:   # missing_files found SINGLE
            weight_map, shards = None, [SINGLE]

        def rename(name: str):
            if name.startswith(SKIPPED_PREFIXES):
                return None
            if name.startswith(TEXT_PREFIX):
                return name[len(TEXT_PREFIX):]
            if name == "lm_head.weight":
                return name
            if name.startswith("model.") and not name.startswith("model.language_model"):
                return name[len("model."):]  # plain text-only checkpoints (Qwen3_5ForCausalLM layout)
            raise CheckpointError(f"unexpected tensor {name}")

        refs: dict[str, TensorRef] = {}
        for shard in shards:
            for short, ref in self._refs(self.path / shard, rename).items():
                if weight_map is not None and weight_map.get(_full_name(short)) not in (shard, None):
                    raise CheckpointError(f"{self.path / shard}: tensor {ref.name} is listed in another shard "
                                          f"({weight_map.get(ref.name)}) by the index")
                refs[short] = ref
        if weight_map is not None:
            missing = [n for n in weight_map if not n.startswith(SKIPPED_PREFIXES)
                       and _short_name(n) not in refs]
            if missing:
                raise CheckpointError(f"{index}: tensors listed but not found in their shard: {missing[:5]}")
        return refs

    def text_f32(self, name: str) -> np.ndarray:
        return to_float32(self.text_tensors[name])

    def shard_tensors(self, prefix: str) -> dict[str, TensorRef]:
        """Every tensor of the model shards whose name starts with ``prefix``, by its name without the prefix (the
        vision tower's ``model.visual.*``); the shards the index lists for them, or model.safetensors."""
        index = self.path / INDEX
        if index.is_file():
            shards = sorted({s for n, s in _weight_map(index).items() if n.startswith(prefix)})
        else:
            shards = [SINGLE]
        out = {}
        for shard in shards:
            f = self._open(self.path / shard)
            out.update({n[len(prefix):]: f.ref(n) for n in f.names() if n.startswith(prefix)})
        return out

    def head_f32(self, name: str) -> np.ndarray:
        return to_float32(self.head_tensors[name])


def missing_files(directory: Path) -> list[str]:
    """The files clefcore reads that ``directory`` lacks, by name: READ_FILES, the index and every shard it names
    (or SINGLE, without an index). A link to nowhere, as a cache's interrupted download leaves, counts as missing."""
    index = directory / INDEX
    if index.is_file():
        weights = sorted(set(_weight_map(index).values()))
    else:
        weights = [SINGLE if (directory / SINGLE).is_file() else INDEX]
    return [name for name in (*READ_FILES, *weights) if not (directory / name).is_file()]


def _weight_map(index: Path) -> dict[str, str]:
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: no weight_map of tensor names to shard files")
    for shard in set(weight_map.values()):
        # a shard is a file beside the index: a path would read whatever file it names, inside or outside
        if not _plain_file_name(shard):
            raise CheckpointError(f"{index}: shard {shard[:200]!r} is not a plain file name in the model directory "
                                  f"(no path separators, '..', '.' or empty names)")
    return weight_map


def _plain_file_name(name: str) -> bool:
    return name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


def _full_name(short: str) -> str:
    return short if short == "lm_head.weight" else TEXT_PREFIX + short


def _short_name(full: str) -> str:
    return full[len(TEXT_PREFIX):] if full.startswith(TEXT_PREFIX) else full


def expected_text_shapes(c: TextConfig) -> dict[str, tuple[int, ...]]:
    h, i = c.hidden_size, c.intermediate_size
    shapes = {"embed_tokens.weight": (c.vocab_size, h), "norm.weight": (h,), "lm_head.weight": (c.vocab_size, h)}
    for n, kind in enumerate(c.layer_types):
        p = f"layers.{n}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i)})
        if kind == "full_attention":
            q, kv, d = c.num_heads, c.num_kv_heads, c.head_dim
            shapes.update({p + "self_attn.q_proj.weight": (2 * q * d, h), p + "self_attn.k_proj.weight": (kv * d, h),
                           p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, q * d),
                           p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        else:
            hv, vd = c.lin_v_heads, c.lin_v_dim
            a = p + "linear_attn."
            shapes.update({a + "in_proj_qkv.weight": (c.conv_dim, h), a + "in_proj_z.weight": (hv * vd, h),
                           a + "in_proj_b.weight": (hv, h), a + "in_proj_a.weight": (hv, h),
                           a + "conv1d.weight": (c.conv_dim, 1, c.conv_kernel), a + "dt_bias": (hv,),
                           a + "A_log": (hv,), a + "norm.weight": (vd,), a + "out_proj.weight": (h, hv * vd)})
    return shapes


def expected_head_shapes(c: HeadConfig) -> dict[str, tuple[int, ...]]:
    H, W, F = c.hidden_size, c.width, c.feedforward
    s = {"hidden_norm.weight": (H,), "hidden_norm.bias": (H,), "type_embedding.weight": (3, W),
         "prior_logit_scale": (), "joint_logit_scale": (), "residual_gate": (),
         "residual_scorer.0.weight": (W, 4 * W), "residual_scorer.0.bias": (W,),
         "residual_scorer.3.weight": (1, W), "residual_scorer.3.bias": (1,)}
    for p in ("memory", "question", "option_question", "global", "option_context", "option_lexical"):
        s[f"{p}_projection.weight"] = (W, H)
    for n in ("option_summary_norm", "field_norm", "option_norm"):
        s[f"{n}.weight"] = s[f"{n}.bias"] = (W,)

    def mha(p):
        s.update({p + "in_proj_weight": (3 * W, W), p + "in_proj_bias": (3 * W,),
                  p + "out_proj.weight": (W, W), p + "out_proj.bias": (W,)})

    for i in range(c.routing_layers):
        p = f"evidence_layers.{i}."
        for n in ("query_norm", "memory_norm", "feedforward_norm"):
            s[p + n + ".weight"] = s[p + n + ".bias"] = (W,)
        mha(p + "attention.")
        s.update({p + "feedforward.0.weight": (F, W), p + "feedforward.0.bias": (F,),
                  p + "feedforward.3.weight": (W, F), p + "feedforward.3.bias": (W,)})
    for j in range(c.layers):
        p = f"layers.{j}."
        mha(p + "self_attn.")
        mha(p + "multihead_attn.")
        s.update({p + "linear1.weight": (F, W), p + "linear1.bias": (F,),
                  p + "linear2.weight": (W, F), p + "linear2.bias": (W,)})
        for n in ("norm1", "norm2", "norm3"):
            s[p + n + ".weight"] = s[p + n + ".bias"] = (W,)
    return s


def check_shapes(ck: Checkpoint) -> None:
    for expected, refs, what in ((expected_text_shapes(ck.text), ck.text_tensors, "backbone"),
                                 (expected_head_shapes(ck.head_config), ck.head_tensors, "joint head")):
        for name, shape in expected.items():
            ref = refs.get(name)
            if ref is None:
                raise CheckpointError(f"{ck.path}: {what} tensor {_full_name(name) if what == 'backbone' else name} "
                                      f"is missing")
            if ref.shape != shape:
                raise CheckpointError(f"{ref.file}: tensor {ref.name} has shape {list(ref.shape)}, "
                                      f"expected {list(shape)}")
        extra = sorted(set(refs) - set(expected))
        if extra:
            raise CheckpointError(f"{refs[extra[0]].file}: unexpected {what} tensor {refs[extra[0]].name}"
                                  + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
