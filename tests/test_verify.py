"""`clefcore verify` on the golden tiny checkpoint (its one-block vision tower packs an image request beside
the text one): passes when the paths agree, names what a broken weight touches; on a GPU, each GEMM choice."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpu_only import HAVE_CUBLAS, MARKS

from clefcore import verify
from clefcore.backends.cpu import CpuOps
from clefcore.checkpoint import Checkpoint
from clefcore.model import vision
from clefcore.model.params import load_params

MODEL = Path(__file__).parent / "golden" / "model"
cpu = CpuOps()


def test_verify_runs_the_example_request_which_covers_every_question_type():
    from clefcore.encode import Encoder
    from clefcore.example_request import support_ticket
    from clefcore.tokenize import Tokenizer
    from clefcore.validate import validate_request
    ck = Checkpoint(MODEL)
    rec = verify.records(ck, False)[0]
    want = Encoder(Tokenizer(ck.tokenizer_path)).encode(validate_request(support_ticket(), "cloudflare"), 16384)
    assert np.array_equal(rec.input_ids, want.input_ids)
    assert sorted(q.type_index for q in rec.questions) == [0, 1, 2]
    assert len(rec.input_ids) > 100 and not rec.state_truncated
    cut = verify.records(ck, False, context_length=len(want.input_ids) - 5)[0]     # the engine's limit, not 16384
    assert len(cut.input_ids) == len(want.input_ids) - 5 and cut.state_truncated


def loaded():
    ck = Checkpoint(MODEL)
    p = load_params(ck, cpu)
    vp, why = vision.attach(ck, cpu, p)
    assert vp is not None, why
    return ck, p, vp


def test_builtin_image_request_is_resized_and_not_square():
    ck = Checkpoint(MODEL)
    text, image = verify.records(ck, with_image=True)
    (start, end, rows, cols), = image.image_spans
    assert (rows, cols) == (7, 10) and end - start == 70                 # 208 px high -> 224: a real resize
    assert len(image.input_ids) == len(text.input_ids) + 70 + 3          # pads, vision start / end, "\n"


def test_compare_passes_for_the_reference_itself():
    ck, p, vp = loaded()
    lines = []
    assert verify.compare(ck, cpu, p, out=lines.append, vision_params=vp)
    assert lines[-1] == "verify: PASS"
    assert lines[0].startswith("vision tower, one 320x208 PNG (14 x 20 patches, 70 image tokens)")
    assert "(with an image)" in lines[1] and " request with an image:" in lines
    assert not any("beyond tolerance" in line for line in lines)


@pytest.mark.parametrize("where,name,flag", [("layer 2", "mlp.down_proj.weight", r"\s*2\s"),
                                             ("tower", "blocks.0.mlp.linear_fc2.weight", "vision tower")])
def test_compare_flags_a_perturbed_weight(where, name, flag):
    ck, p, vp = loaded()
    weights = p.layers[2] if where == "layer 2" else vp.w
    weights[name] = weights[name] * np.float32(1.5)
    lines = []
    assert not verify.compare(ck, cpu, p, out=lines.append, vision_params=vp)
    assert lines[-1] == "verify: FAIL"
    flagged = [line for line in lines if "beyond tolerance" in line]
    assert flagged and re.match(flag, flagged[0])


def test_compare_without_the_tower_runs_the_text_request_alone(gold_params):
    ck = Checkpoint(MODEL)
    lines = []
    assert verify.compare(ck, cpu, gold_params, out=lines.append)
    assert "(text); per-layer" in lines[0] and not any("image" in line for line in lines)


@pytest.mark.parametrize("precision", ["fast", "exact"])
@pytest.mark.parametrize("gemm", ["auto", "wmma", "cublas"])
@pytest.mark.parametrize("device", [pytest.param("cuda:0", marks=MARKS)])
def test_verify_command_on_gpu(device, gemm, precision):
    if gemm == "cublas" and not HAVE_CUBLAS:
        pytest.skip("cuBLAS cannot be loaded here")
    r = subprocess.run([sys.executable, "-m", "clefcore.verify", "--model", str(MODEL), "--device", device,
                        "--gemm", gemm, "--precision", precision], capture_output=True, text=True, timeout=600)
    print(r.stdout[-3000:])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"precision {precision} (" in r.stdout
    assert f"gemm {gemm}" in r.stdout
    assert "verify: PASS" in r.stdout and "beyond tolerance" not in r.stdout
    assert "vision tower, one 320x208 PNG" in r.stdout and "(with an image)" in r.stdout


@pytest.mark.parametrize("device", [pytest.param("cuda:0", marks=MARKS)])
def test_verify_command_no_images(device):
    r = subprocess.run([sys.executable, "-m", "clefcore.verify", "--model", str(MODEL), "--device", device,
                        "--no-images"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "request with an image: not run (--no-images)" in r.stdout and "vision tower" not in r.stdout
