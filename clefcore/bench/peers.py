"""The peer ``clefcore bench`` measures against in the same process: transformers' Qwen3.5 at the same shapes
(random bf16 weights, sdpa, flash-linear-attention where it imports), for the text lengths and for the image case
(its own image processor on the same PNG). Optional in every run: where torch or transformers do not import, or
a model does not build, the JSON says why instead of a number.

The peer runs as a user tuning it would: its Gated DeltaNet's causal conv goes through a fused kernel, the
``causal_conv1d`` package's where it imports (transformers picks it up itself), else flash-linear-attention's
(routed here: transformers looks for the ``causal_conv1d`` package only, and otherwise runs a reference PyTorch
conv). The JSON's ``variant`` says which conv ran."""

from __future__ import annotations

import contextlib
import importlib.util
import statistics
import time

import numpy as np

from .records import image_record
from .timing import spread, wall_ms


def _import_transformers(out, key, label):
    """(torch, transformers), or None with why recorded in out[key] (the peer is optional in every run)."""
    try:
        import torch
        import transformers
    except Exception as e:  # noqa: BLE001
        print(f"  {label}: not run ({e.__class__.__name__}: {e})")
        out[key] = f"not importable: {e}"
        return None
    return torch, transformers


def transformers_side(text_cfg, lengths, packed, reps, out):
    peer = _import_transformers(out, "transformers", "transformers")
    if peer is None:
        return
    torch, transformers = peer
    try:
        cfg_cls = getattr(transformers, "Qwen3_5TextConfig")
        mdl_cls = getattr(transformers, "Qwen3_5TextModel", None) or getattr(transformers, "Qwen3_5ForCausalLM")
        cfg = cfg_cls(**_hf_text_kwargs(text_cfg), attn_implementation="sdpa")
        with torch.device("cuda"):
            m = mdl_cls._from_config(cfg, torch_dtype=torch.bfloat16).eval()
        with peer_conv(transformers) as fla_v:
            res = []
            cases = [(f"{L} tokens", 1, L) for L in lengths]
            if packed:
                n, l_ = (int(v) for v in packed.split("x"))
                cases.append((f"{n}x{l_} padded batch", n, l_))
            for label, B, L in cases:
                ids = torch.randint(0, text_cfg.vocab_size, (B, L), device="cuda")
                with torch.no_grad():
                    t0 = time.perf_counter()
                    m(input_ids=ids)
                    torch.cuda.synchronize()
                    first = time.perf_counter() - t0
                    if first > 60:
                        res.append(dict(case=label, ms=first * 1e3, note="single run"))
                        print(f"  transformers {label:16s} {first * 1e3:9.1f} ms (single run)")
                        break
                    ts = []
                    for _ in range(reps):
                        t0 = time.perf_counter()
                        m(input_ids=ids)
                        torch.cuda.synchronize()
                        ts.append((time.perf_counter() - t0) * 1e3)
                ms = statistics.median(ts)
                res.append(dict(case=label, ms=ms, runs_ms=ts, tok_s=B * L / ms * 1e3))
                print(f"  transformers {label:16s} {ms:9.1f} ms  {B * L / ms * 1e3:9.0f} tok/s  (runs {spread(ts)}; "
                      f"{fla_v})")
        out["transformers"] = dict(version=transformers.__version__, variant=fla_v, results=res)
        del m
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001
        print(f"  transformers: failed ({e.__class__.__name__}: {e})")
        out["transformers"] = f"failed: {e}"


def _hf_text_kwargs(c) -> dict:
    """transformers' Qwen3.5 text config fields for clefcore's TextConfig ``c``."""
    return dict(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
                num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
                linear_num_key_heads=c.lin_k_heads, linear_num_value_heads=c.lin_v_heads,
                linear_key_head_dim=c.lin_k_dim, linear_value_head_dim=c.lin_v_dim, vocab_size=c.vocab_size,
                layer_types=list(c.layer_types))


def _fla_conv(hidden_states, weight, bias=None, activation=None, **_):
    """transformers' ``causal_conv1d_fn`` (x [B, C, T], weight [C, K]) -> [B, C, T] on flash-linear-attention's
    causal conv, which takes and returns [B, T, C]."""
    from fla.modules.causal_conv1d import causal_conv1d
    y, _state = causal_conv1d(hidden_states.transpose(1, 2), weight, bias, activation=activation)
    return y.transpose(1, 2)


@contextlib.contextmanager
def peer_conv(transformers):
    """While open, transformers' Qwen3.5 runs its causal conv through a fused kernel where one imports; yields
    what the peer runs ("flash-linear-attention; conv: ...")."""
    modeling = importlib.import_module(transformers.__name__ + ".models.qwen3_5.modeling_qwen3_5")
    fla = importlib.util.find_spec("fla") is not None
    rule = "flash-linear-attention" if fla else "torch reference delta rule (flash-linear-attention not installed)"
    if importlib.util.find_spec("causal_conv1d") is not None:
        yield f"{rule}; conv: causal_conv1d package"
        return
    if not fla:
        yield f"{rule}; conv: torch reference (neither causal_conv1d nor flash-linear-attention installed)"
        return
    saved = modeling.causal_conv1d_fn
    modeling.causal_conv1d_fn = _fla_conv
    try:
        yield f"{rule}; conv: flash-linear-attention's causal_conv1d"
    finally:
        modeling.causal_conv1d_fn = saved


def transformers_image_side(text_cfg, vision_cfg, section, size, reps, out, device="cuda"):
    """The image case on transformers: a Qwen3_5Model (tower + backbone; bf16, sdpa, random weights) with the
    same text and vision shapes and M-RoPE section. Each timed call hands its image processor the same PNG as a
    data URL (as the reference's processor gets it: decoding, resize, patches) and runs the model; its text twin
    is the same ids without the image. Recorded in out["transformers_image"], or why it did not run."""
    peer = _import_transformers(out, "transformers_image", "transformers (image)")
    if peer is None:
        return
    torch, transformers = peer
    try:
        from ..synth import data_url, picture_png
        w, h = size
        data = picture_png(w, h)
        rec, px = image_record(data, text_cfg.vocab_size)
        (start, end, _, _), = rec.image_spans
        V = text_cfg.vocab_size
        pad_id, start_id, end_id = V - 3, V - 2, V - 1        # the vision specials: ids the text never draws
        text_ids = np.asarray(rec.input_ids) % (V - 3)
        image_ids = text_ids.copy()
        image_ids[start - 1], image_ids[start:end], image_ids[end] = start_id, pad_id, end_id
        c, v = text_cfg, vision_cfg
        rope = dict(rope_type="default", rope_theta=c.rope_theta, partial_rotary_factor=c.rotary_dim / c.head_dim,
                    mrope_section=list(section), mrope_interleaved=True)
        cfg = transformers.Qwen3_5Config(
            text_config=dict(_hf_text_kwargs(c), rope_parameters=rope),
            vision_config=dict(depth=v.depth, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                               num_heads=v.num_heads, num_position_embeddings=v.num_position_embeddings,
                               out_hidden_size=v.out_hidden_size, patch_size=v.patch_size,
                               temporal_patch_size=v.temporal_patch_size, spatial_merge_size=v.spatial_merge_size,
                               in_channels=v.in_channels),
            image_token_id=pad_id, vision_start_token_id=start_id, vision_end_token_id=end_id,
            attn_implementation="sdpa")
        with torch.device(device):
            m = transformers.Qwen3_5Model._from_config(cfg, torch_dtype=torch.bfloat16).eval()
        proc = transformers.Qwen2VLImageProcessor(
            patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size, merge_size=v.spatial_merge_size,
            size={"shortest_edge": 65536, "longest_edge": 16777216}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
        url = data_url(data)
        image_t = torch.tensor(image_ids[None], device=device)
        text_t = torch.tensor(text_ids[None], device=device)
        mm = (image_t == pad_id).long()
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

        def run_image():
            inputs = proc(images=[url], return_tensors="pt")
            m(input_ids=image_t, pixel_values=inputs["pixel_values"].to(device, torch.bfloat16),
              image_grid_thw=inputs["image_grid_thw"].to(device), mm_token_type_ids=mm)
            sync()

        def run_text():
            m(input_ids=text_t)
            sync()

        with torch.no_grad(), peer_conv(transformers) as variant:
            image_ms, text_ms = wall_ms(run_image, reps), wall_ms(run_text, reps)
        res = dict(version=transformers.__version__, variant=variant, processor=type(proc).__name__,
                   tokens=len(image_ids), image_tokens=px.num_tokens, image_ms=image_ms, text_ms=text_ms,
                   ratio=image_ms / text_ms)
        print(f"  transformers image {w}x{h}: {image_ms:.1f} ms against text-only {text_ms:.1f} ms = "
              f"{image_ms / text_ms:.2f}x ({res['processor']}; {res['variant']})")
        out["transformers_image"] = res
    except Exception as e:  # noqa: BLE001
        print(f"  transformers (image): failed ({e.__class__.__name__}: {e})")
        out["transformers_image"] = f"failed: {e.__class__.__name__}: {e}"
