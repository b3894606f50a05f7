"""The numpy backbone against transformers' Qwen3_5 text model in fp32: three random tiny configurations,
lengths off the 64-token GDN chunk, every parameter randomised (norm weights too: 1 + w vs w)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from clefcore.backends.cpu import CpuOps  # noqa: E402
from clefcore.checkpoint import Checkpoint, write_safetensors  # noqa: E402
from clefcore.model.backbone import backbone  # noqa: E402
from clefcore.model.params import load_params  # noqa: E402

GOLDEN_MODEL = Path(__file__).parent / "golden" / "model"

CONFIGS = [
    # hidden stays 64 so the golden joint head (hidden 64) completes the checkpoint directory
    dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
         intermediate_size=96),
    dict(num_hidden_layers=8, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
         linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=32, linear_value_head_dim=24,
         intermediate_size=160),
    dict(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, head_dim=16,
         linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8,
         intermediate_size=64),
]
LENGTHS = [1, 63, 65, 150]


def hf_model(cfg: dict, seed: int):
    torch.manual_seed(seed)
    config = transformers.Qwen3_5TextConfig(
        hidden_size=64, vocab_size=512, rms_norm_eps=1e-6, linear_conv_kernel_dim=4, full_attention_interval=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        partial_rotary_factor=0.25, tie_word_embeddings=False, **cfg)
    m = transformers.Qwen3_5ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-1.0, 1.5)
            elif "norm" in name:
                p.uniform_(0.7, 1.3) if name.endswith("linear_attn.norm.weight") else p.uniform_(-0.5, 0.5)
            else:
                p.normal_(0.0, 1.0 / np.sqrt(p.shape[-1]) if p.dim() > 1 else 0.3)
    return m, config


def save_checkpoint(m, config, out: Path) -> Checkpoint:
    out.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "joint_head_config.json", "joint_head.safetensors"):
        shutil.copy(GOLDEN_MODEL / f, out / f)
    (out / "config.json").write_text(json.dumps(config.to_dict()))
    tensors = {}
    for name, t in m.state_dict().items():
        a = t.detach().numpy().astype(np.float32)
        tensors[name] = ("F32", a.shape, lambda a=a: a)
    write_safetensors(out / "model.safetensors", tensors)
    return Checkpoint(out)


@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_backbone_matches_transformers(index, tmp_path):
    m, config = hf_model(CONFIGS[index], seed=index)
    cpu = CpuOps()
    params = load_params(save_checkpoint(m, config, tmp_path / "ckpt"), cpu)
    rng = np.random.default_rng(index)
    seqs = [rng.integers(0, 512, n) for n in LENGTHS]
    want = []
    for ids in seqs:
        with torch.no_grad():
            out = m.model(input_ids=torch.tensor(ids)[None], use_cache=False)
        want.append(out.last_hidden_state[0].numpy())
    # one by one, then all packed in one stream
    for ids, w in zip(seqs, want):
        hs, _ = backbone(cpu, params, ids, np.array([0, len(ids)]), np.arange(len(ids)))
        rel = np.abs(hs - w).max() / np.abs(w).max()
        assert rel < 1e-4, f"config {index}, length {len(ids)}: rel error {rel:.2e}"
    cu = np.concatenate([[0], np.cumsum(LENGTHS)])
    packed, _ = backbone(cpu, params, np.concatenate(seqs), cu,
                         np.concatenate([np.arange(n) for n in LENGTHS]))
    for i, w in enumerate(want):
        rel = np.abs(packed[cu[i]:cu[i + 1]] - w).max() / np.abs(w).max()
        assert rel < 1e-4, f"config {index}, packed sequence {i}: rel error {rel:.2e}"
