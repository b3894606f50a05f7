"""Random-weight checkpoints in the Cloudflare/clef-flash release layout, for demos, tests and benchmarks.

The answers of such a model are meaningless; the shapes, dtypes, file layout, tokenizer conventions (Qwen
special tokens, byte-level BPE, NFC + Split regex) are the release's. ``clef-flash`` has the real 9B shapes
(~19 GB) and is written tensor by tensor, shard by shard, so memory stays bounded.

The vision tower is a one-tensor stub by default (a text-only loader must skip ``model.visual.*``, and image
requests are refused as "incomplete"); ``vision=True`` writes the whole tower at the preset's shapes with its
``vision_config``. Also here: ``picture_png``, a deterministic test picture for image requests.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import contextlib
import io
import json
import multiprocessing
import os
from pathlib import Path

import numpy as np

from .checkpoint import (
    TEXT_PREFIX,
    bf16_bits,
    expected_head_shapes,
    expected_text_shapes,
    write_safetensors,
)
from .config import HeadConfig, TextConfig
from .random_weights import draw, kind_of
from .tokenize import SPLIT_REGEX

PRESETS = {
    "tiny": dict(text=dict(hidden_size=64, intermediate_size=160, num_hidden_layers=8, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                           linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=2048),
                 head=dict(hidden_size=64, width=32, routing_layers=2, layers=2, heads=4, feedforward=96),
                 # the golden-images fixture model's tower (tests/golden_images/model)
                 vision=dict(depth=2, hidden_size=48, intermediate_size=112, num_heads=3, num_position_embeddings=36),
                 learned=2000, special_base=2000, shard_bytes=1 << 20),
    "clef-flash": dict(text=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                                 num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                                 linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                                 linear_value_head_dim=128, vocab_size=248320),
                       head=dict(hidden_size=4096, width=1024, routing_layers=2, layers=4, heads=16,
                                 feedforward=4096),
                       # the release's tower: qwen35-backbone.md §1 (vision_config) and §2 (model.visual.*)
                       vision=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                                   num_position_embeddings=2304),
                       learned=4000, special_base=248044, shard_bytes=5 << 30),
}

# Qwen3.5 added tokens in id order from <|endoftext|> (248044 in the release); <think> pair is not "special".
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
                  "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                  "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}

CORPUS = [
    "Read the complete state and schema. Decide every field jointly. Each answer must be exactly one of "
    "that field's allowed options.", "STATE:", "SCHEMA FIELDS:", "FIELD", "ID:", "TYPE:", "INSTRUCTION:",
    "ALLOWED OPTIONS:", "OPTION", "END FIELD", "JOINT SCHEMA DECISIONS:", "noul choice score",
    '{"description":"The proposition is true or the answer is yes.","option_id":"true"}',
    '{"description":"The proposition is false or the answer is no.","option_id":"false"}',
    "Our checkout started returning errors and orders are blocked. Which team should handle the message?",
    "billing technical support sales urgent severity payments invoices refunds outages bugs configuration",
    "The quick brown fox jumps over the lazy dog 0123456789 user assistant system",
]


def vision_config_json(v: dict, out_hidden_size: int) -> dict:
    """config.json's vision_config as the release has it (qwen35-backbone.md §1)."""
    return dict(deepstack_visual_indexes=[], depth=v["depth"], hidden_act="gelu_pytorch_tanh",
                hidden_size=v["hidden_size"], in_channels=3, initializer_range=0.02,
                intermediate_size=v["intermediate_size"], model_type="qwen3_5", num_heads=v["num_heads"],
                num_position_embeddings=v["num_position_embeddings"], out_hidden_size=out_hidden_size,
                patch_size=16, spatial_merge_size=2, temporal_patch_size=2)


def config_json(preset: str, vision: bool) -> dict:
    P = PRESETS[preset]
    cfg = text_config_json(P["text"], P["special_base"])
    if vision:
        cfg["vision_config"] = vision_config_json(P["vision"], P["text"]["hidden_size"])
    return cfg


def text_config_json(t: dict, special_base: int) -> dict:
    n = t["num_hidden_layers"]
    text = dict(t, model_type="qwen3_5_text", attention_bias=False, attn_output_gate=True, hidden_act="silu",
                full_attention_interval=4, rms_norm_eps=1e-6, linear_conv_kernel_dim=4, tie_word_embeddings=False,
                layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
                partial_rotary_factor=0.25, max_position_embeddings=262144, eos_token_id=special_base,
                rope_parameters=dict(rope_type="default", rope_theta=10000000, partial_rotary_factor=0.25,
                                     mrope_section=[11, 11, 10] if t["head_dim"] == 256 else [2, 1, 1],
                                     mrope_interleaved=True), dtype="bfloat16")
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
            "tie_word_embeddings": False, "image_token_id": special_base + 12, "video_token_id": special_base + 13,
            "vision_start_token_id": special_base + 9, "vision_end_token_id": special_base + 10}


def build_tokenizer(learned: int, special_base: int) -> dict:
    """A byte-level BPE trained on a fixed corpus, wrapped like the release's tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=learned, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, min_frequency=1)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    spec = json.loads(tok.to_str())
    spec["normalizer"] = {"type": "NFC"}
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": SPLIT_REGEX["qwen35"]}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
    spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    spec["post_processor"] = None
    # tokenizers only honours added-token ids that follow the model vocabulary, so pad it with entries no merge
    # can produce up to the first special id (the release's vocabulary is dense up to <|endoftext|> too)
    vocab = spec["model"]["vocab"]
    for i in range(len(vocab), special_base):
        vocab[f"<|unused_{i}|>"] = i
    spec["added_tokens"] = [{"id": special_base + i, "content": s, "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": False, "special": s not in NOT_SPECIAL}
                            for i, s in enumerate(SPECIAL_TOKENS)]
    return spec


def _maker(rng_seed: int, name: str, shape: tuple, kind: str, tag: str):
    """A deterministic generator per tensor (seeded by name) so shards can be written in any order; values by
    random_weights' rules. Large matrices are generated in row blocks into the output buffer to bound peak
    memory."""
    def make():
        rng = np.random.default_rng(np.random.SeedSequence([rng_seed, *name.encode()]))
        convert = bf16_bits if tag == "BF16" else (lambda x: np.asarray(x, np.float32))
        if len(shape) < 2:
            return convert(np.asarray(draw(rng, kind, shape), np.float32))
        out = np.empty(shape, np.uint16 if tag == "BF16" else np.float32)
        step = max(1, (1 << 24) // int(np.prod(shape[1:])))
        for r in range(0, shape[0], step):
            block = (min(step, shape[0] - r),) + tuple(shape[1:])
            out[r:r + block[0]] = convert(np.asarray(draw(rng, kind, block), np.float32))
        return out
    return make


def _text_shards(preset: str, seed: int, vision: bool = False) -> list[tuple[str, dict]]:
    """The model shards' tensor specs (text, MTP stub, vision tower or its stub), cut into shards of at most
    ``shard_bytes``: [(file name, {name: spec})]."""
    P = PRESETS[preset]
    cfg = config_json(preset, vision)
    text = TextConfig.from_dict(cfg)
    specs = {}
    for short, shape in expected_text_shapes(text).items():
        full = short if short == "lm_head.weight" else TEXT_PREFIX + short
        tag = "F32" if short.endswith(("A_log", "linear_attn.norm.weight")) else "BF16"
        specs[full] = (tag, shape, _maker(seed, full, shape, kind_of(short, True), tag))
    # the release also ships an MTP block and a vision tower; a text-only loader must skip them
    extras = [("mtp.fc.weight", (text.hidden_size, 2 * text.hidden_size), "matrix")]
    if vision:
        from .model.vision import PREFIX, VisionConfig, expected_vision_shapes
        extras += [(PREFIX + n, shape, kind_of(n, False))
                   for n, shape in expected_vision_shapes(VisionConfig.from_dict(cfg["vision_config"])).items()]
    else:
        extras.append(("model.visual.merger.norm.weight", (32,), "matrix"))
    for extra, shape, kind in extras:
        specs[extra] = ("BF16", shape, _maker(seed, extra, shape, kind, "BF16"))
    shards, current, size = [], {}, 0
    for name, spec in specs.items():
        nbytes = int(np.prod(spec[1], dtype=np.int64)) * (4 if spec[0] == "F32" else 2)
        if current and size + nbytes > P["shard_bytes"]:
            shards.append(current)
            current, size = {}, 0
        current[name] = spec
        size += nbytes
    shards.append(current)
    return [(f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors", sh) for i, sh in enumerate(shards)]


def _write_shard(preset: str, seed: int, vision: bool, out: Path, index: int) -> int:
    # a worker process rebuilds the plan (the tensor makers are closures, not picklable); values are seeded
    # per tensor name, so the files do not depend on which process writes them
    fname, shard = _text_shards(preset, seed, vision)[index]
    return write_safetensors(out / fname, shard)


def write(preset: str, seed: int, out: str | Path, progress=None, jobs: int | None = None,
          vision: bool = False) -> Path:
    """Write the checkpoint; shards are generated by up to ``jobs`` processes (default: one per CPU).
    ``vision``: a complete random vision tower instead of the stub (see the module doc)."""
    if preset not in PRESETS:
        raise ValueError(f"preset {preset!r}: expected one of {', '.join(PRESETS)}")
    P = PRESETS[preset]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config_json(preset, vision)
    head = HeadConfig.from_dict(P["head"])
    shards = _text_shards(preset, seed, vision)
    jobs = max(1, min(len(shards), jobs or os.cpu_count() or 1))
    sizes = [0] * len(shards)
    with contextlib.ExitStack() as stack:
        if jobs == 1:
            done = ((i, _write_shard(preset, seed, vision, out, i)) for i in range(len(shards)))
        else:
            pool = stack.enter_context(cf.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")))
            futs = {pool.submit(_write_shard, preset, seed, vision, out, i): i for i in range(len(shards))}
            done = ((futs[f], f.result()) for f in cf.as_completed(futs))
        for n, (i, size) in enumerate(done, 1):
            sizes[i] = size
            if progress:
                progress(n, len(shards) + 1, shards[i][0])
    total = sum(sizes)
    weight_map = {n: fname for fname, shard in shards for n in shard}
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))

    hspecs = {n: ("BF16", s, _maker(seed, "head." + n, s, kind_of(n, False), "BF16"))
              for n, s in expected_head_shapes(head).items()}
    write_safetensors(out / "joint_head.safetensors", hspecs)
    if progress:
        progress(len(shards) + 1, len(shards) + 1, "joint_head.safetensors")
    (out / "joint_head_config.json").write_text(json.dumps(P["head"], indent=2))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": P["special_base"] + 2}))
    (out / "tokenizer.json").write_text(json.dumps(build_tokenizer(P["learned"], P["special_base"]),
                                                   ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "add_bos_token": False, "add_prefix_space": False,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "model_max_length": 262144}, indent=2))
    (out / "SYNTHETIC").write_text(f"random weights: preset {preset}, seed {seed}"
                                   f"{', full vision tower' if vision else ''}; answers are meaningless\n")
    return out


def picture_png(width: int, height: int, seed: int = 0) -> bytes:
    """A deterministic RGB picture as PNG bytes, for image requests in tests, ``clefcore verify`` and the bench:
    smooth colour gradients under a few flat discs, like a screenshot or a simple diagram (no noise, so it
    compresses and decodes like one)."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.stack([x / width, y / height, (x + y) / (width + height)], axis=-1) * 255
    for _ in range(6):
        cx, cy = rng.uniform(0, width), rng.uniform(0, height)
        r = rng.uniform(0.05, 0.25) * min(width, height)
        img[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = rng.uniform(0, 255, 3)
    buf = io.BytesIO()
    Image.fromarray(img.astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def data_url(png: bytes) -> str:
    """PNG bytes as the wire's data URL form of an image."""
    return "data:image/png;base64," + base64.b64encode(png).decode()
