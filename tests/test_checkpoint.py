"""Checkpoint loading: release layout, single file, exact bf16 widening, and errors naming file and tensor."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

import clefcore
from clefcore import synth
from clefcore.checkpoint import Checkpoint, SafetensorsFile, bf16_bits, missing_files, to_float32, write_safetensors
from clefcore.errors import CheckpointError
from clefcore.example_request import support_ticket

GOLDEN_MODEL = Path(__file__).parent / "golden" / "model"


@pytest.fixture
def model_copy(tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(GOLDEN_MODEL, dst)
    for f in dst.iterdir():
        f.chmod(0o644)
    return dst


def test_release_layout_skips_visual_and_mtp():
    ck = Checkpoint(GOLDEN_MODEL)
    index = json.loads((GOLDEN_MODEL / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(n.startswith("model.visual.") for n in index) and any(n.startswith("mtp.") for n in index)
    assert not any(n.startswith(("visual", "mtp", "model.")) for n in ck.text_tensors)
    assert len(ck.files) == 3                      # two shards + the head, each mapped once
    assert ck.text_tensors["layers.0.linear_attn.A_log"].dtype == "F32"
    assert ck.text_tensors["embed_tokens.weight"].dtype == "BF16"


def test_bf16_widening_is_exact_and_round_trips():
    x = np.array([1.0, -2.5, 3.140625, 1e-30, 65504.0, -0.0, np.inf], np.float32)
    bits = bf16_bits(x)
    with_ml_dtypes = pytest.importorskip("ml_dtypes")
    np.testing.assert_array_equal(bits, x.astype(with_ml_dtypes.bfloat16).view(np.uint16))
    ref = type("R", (), {"dtype": "BF16", "raw": bits})
    np.testing.assert_array_equal(to_float32(ref), x.astype(with_ml_dtypes.bfloat16).astype(np.float32))


def test_single_file_checkpoint(model_copy):
    refs = {}
    for shard in sorted(model_copy.glob("model-*.safetensors")):
        f = SafetensorsFile(shard)
        for n in f.names():
            r = f.ref(n)
            refs[n] = (r.dtype, r.shape, lambda a=np.array(r.raw): a)
        shard.unlink()
    (model_copy / "model.safetensors.index.json").unlink()
    write_safetensors(model_copy / "model.safetensors", refs)
    a = Checkpoint(model_copy)
    b = Checkpoint(GOLDEN_MODEL)
    for n in b.text_tensors:
        np.testing.assert_array_equal(a.text_f32(n), b.text_f32(n))


def _rewrite(path: Path, edit):
    f = SafetensorsFile(path)
    # copy out of the memory map first: the file is truncated and rewritten in place
    specs = {n: (f.ref(n).dtype, f.ref(n).shape, lambda a=np.array(f.ref(n).raw): a) for n in f.names()}
    edit(specs)
    del f
    write_safetensors(path, specs)


@pytest.mark.parametrize("case,needle", [
    ("missing_file", "tokenizer.json: file not found"),
    ("missing_tensor", "model.language_model.layers.0.mlp.up_proj.weight is missing"),
    ("wrong_shape", "model.language_model.norm.weight has shape [3], expected [64]"),
    ("bad_dtype", "unsupported dtype I32"),
    ("unexpected", "unexpected joint head tensor extra.weight"),
    ("bad_config", "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
])
def test_errors_name_the_file_and_tensor(model_copy, case, needle):
    shard = next(p for p in sorted(model_copy.glob("model-*.safetensors"))
                 if "model.language_model.norm.weight" in SafetensorsFile(p).names())
    if case == "missing_file":
        (model_copy / "tokenizer.json").unlink()
    elif case == "missing_tensor":
        for p in model_copy.glob("model-*.safetensors"):
            _rewrite(p, lambda s: s.pop("model.language_model.layers.0.mlp.up_proj.weight", None))
        idx = model_copy / "model.safetensors.index.json"
        data = json.loads(idx.read_text())
        data["weight_map"].pop("model.language_model.layers.0.mlp.up_proj.weight")
        idx.write_text(json.dumps(data))
    elif case == "wrong_shape":
        _rewrite(shard, lambda s: s.update({"model.language_model.norm.weight":
                                            ("BF16", (3,), lambda: np.zeros(3, np.uint16))}))
    elif case == "bad_dtype":   # relabel a 4-byte tensor's header entry as I32
        _rewrite(shard, lambda s: s.update({"model.language_model.norm.weight":
                                            ("F32", (64,), lambda: np.zeros(64, np.float32))}))
        data = shard.read_bytes()
        n = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8:8 + n])
        header["model.language_model.norm.weight"]["dtype"] = "I32"
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        shard.write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + n:])
    elif case == "unexpected":
        _rewrite(model_copy / "joint_head.safetensors",
                 lambda s: s.update({"extra.weight": ("BF16", (2,), lambda: np.zeros(2, np.uint16))}))
    elif case == "bad_config":
        cfg = json.loads((model_copy / "config.json").read_text())
        cfg["text_config"]["num_key_value_heads"] = 3
        (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        clefcore.load(model_copy)
    assert needle in str(e.value)


def test_synthetic_tiny_checkpoint_loads_and_answers(tmp_path):
    out = synth.write("tiny", 7, tmp_path / "tiny", jobs=2)
    engine = clefcore.load(out)
    response = engine.self_check()
    assert list(response["answers"]) == list(support_ticket()["questions"])
    ids = engine.encode(support_ticket()).input_ids
    assert ids[0] == 2001 and 2024 in ids and 2025 in ids     # <|im_start|>, <think>, </think> are single tokens
    # deterministic per seed, whether the shards are written by one process or several
    again = synth.write("tiny", 7, tmp_path / "tiny2", jobs=1)
    files = sorted(out.glob("*.safetensors"))
    assert len(files) >= 3
    for f in files:
        assert f.read_bytes() == (again / f.name).read_bytes()


def test_streamed_reference_params_match_loaded(gold_params):
    """`clefcore verify` streams the fp32 reference weights from disk layer by layer (so it fits hosts with
    less RAM than the fp32 model); the numbers must be the loaded model's exactly."""
    from clefcore import verify
    from clefcore.backends.cpu import CpuOps
    from clefcore.model.backbone import backbone
    ck, cpu, loaded = Checkpoint(GOLDEN_MODEL), CpuOps(), gold_params
    streamed = verify.streamed_reference_params(ck)
    ids = np.arange(130) * 7 % ck.text.vocab_size
    h1, k1 = backbone(cpu, loaded, ids, np.array([0, 60, 130]), np.r_[np.arange(60), np.arange(70)], True)
    h2, k2 = backbone(cpu, streamed, ids, np.array([0, 60, 130]), np.r_[np.arange(60), np.arange(70)], True)
    assert np.array_equal(h1, h2) and all(np.array_equal(a, b) for a, b in zip(k1, k2))
    assert np.array_equal(streamed.lm_head[ids[:5]], loaded.lm_head[ids[:5]])


def test_load_progress_bar_on_a_terminal(monkeypatch):
    import io

    from clefcore import progress
    from clefcore.backends.cpu import CpuOps
    from clefcore.model.params import load_params

    class Tty(io.StringIO):
        def isatty(self):
            return True
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert progress.terminal_bar() is None            # logs and pipes get no bar
    out = Tty()
    monkeypatch.setattr("sys.stderr", out)
    ck = Checkpoint(GOLDEN_MODEL)
    load_params(ck, CpuOps(), progress=progress.terminal_bar("loading"))
    n = len(ck.text_tensors) + len(ck.head_tensors)
    assert out.getvalue().count("\r") == n and out.getvalue().endswith(f"] {n}/{n}\n")


def test_fused_projections_are_stacked_at_load(gold_params):
    """FUSED parts become one weight (rows in the listed order), stored under the fused name only."""
    from clefcore.checkpoint import stack_refs
    from clefcore.model.params import FUSED
    ck, p = Checkpoint(GOLDEN_MODEL), gold_params
    kinds = {"linear_attn.in_proj.weight": "linear_attention", "self_attn.qkv_proj.weight": "full_attention"}
    assert set(FUSED) == set(kinds)
    for fused, parts in FUSED.items():
        owners = [i for i, t in enumerate(ck.text.layer_types) if t == kinds[fused]]
        assert owners
        for i, L in enumerate(p.layers):
            assert not any(q in L for q in parts)
            assert (fused in L) == (i in owners)
        want = np.concatenate([ck.text_f32(f"layers.{owners[0]}.{q}") for q in parts])
        assert np.array_equal(p.layers[owners[0]][fused], want)
    parts = FUSED["linear_attn.in_proj.weight"]
    i = [i for i, t in enumerate(ck.text.layer_types) if t == "linear_attention"][0]
    want = np.concatenate([ck.text_f32(f"layers.{i}.{q}") for q in parts])
    # mixed dtypes widen to fp32; one ref passes through unchanged
    refs = [ck.text_tensors[f"layers.{i}.{q}"] for q in parts[:2]]
    wide = ck.text_f32(f"layers.{i}.{parts[1]}")
    f32 = stack_refs("x", [refs[0], type(refs[1])(refs[1].file, "y", "F32", refs[1].shape, wide)])
    assert f32.dtype == "F32" and np.array_equal(f32.raw, want[:f32.shape[0]])
    assert stack_refs("x", refs[:1]) is refs[0]


@pytest.mark.parametrize("shard", ["/abs", "../outside/model-00001-of-00002.safetensors",
                                   "sub/../model-00001-of-00002.safetensors", "..", ".", "",
                                   "..\\model-00001-of-00002.safetensors"])
def test_shard_names_must_be_plain_file_names(model_copy, tmp_path, shard):
    """The index names the shards; one that names a path (absolute, with '..' or a separator) would read a file
    outside the model directory: here a valid shard copied outside, which would load if it were read."""
    outside = tmp_path / "outside"
    outside.mkdir()
    real = "model-00001-of-00002.safetensors"
    shutil.copy(model_copy / real, outside / real)
    shard = shard.replace("/abs", str(outside / real))
    index = model_copy / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"] = {n: shard if s == real else s for n, s in data["weight_map"].items()}
    index.write_text(json.dumps(data))
    (model_copy / real).unlink()
    for reader in (lambda: clefcore.load(model_copy), lambda: missing_files(model_copy)):
        with pytest.raises(CheckpointError) as e:
            reader()
        assert f"shard {shard!r} is not a plain file name in the model directory" in str(e.value)
