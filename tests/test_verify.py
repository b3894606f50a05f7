"""`clefcore verify`'s comparison on the golden tiny checkpoint: it passes when the two paths agree, flags the
layer a broken weight touches, and (on a GPU) passes for the CUDA backend through the command line with each GEMM choice."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from gpu_only import HAVE_CUBLAS, MARKS  # noqa: E402

from clefcore import model, verify  # noqa: E402
from clefcore.backends import cpu  # noqa: E402
from clefcore.checkpoint import Checkpoint  # noqa: E402

MODEL = Path(__file__).parent / "golden" / "model"


def test_builtin_request_is_valid_and_covers_every_question_type():
    from clefcore.encode import Encoder
    from clefcore.tokenize import Tokenizer
    from clefcore.validate import validate_request
    ck = Checkpoint(MODEL)
    rec = Encoder(Tokenizer(ck.tokenizer_path)).encode(validate_request(verify.REQUEST, "cloudflare"), 16384)
    assert sorted(q.type_index for q in rec.questions) == [0, 1, 2]
    assert len(rec.input_ids) > 100


def test_compare_passes_for_the_reference_itself():
    ck = Checkpoint(MODEL)
    lines = []
    assert verify.compare(ck, cpu, model.load_params(ck, cpu), out=lines.append)
    assert lines[-1] == "verify: PASS"
    assert not any("beyond tolerance" in line for line in lines)


def test_compare_flags_a_perturbed_layer():
    ck = Checkpoint(MODEL)
    p = model.load_params(ck, cpu)
    layer = 2
    w = p.layers[layer]["mlp.down_proj.weight"]
    p.layers[layer]["mlp.down_proj.weight"] = w * np.float32(1.5)
    lines = []
    assert not verify.compare(ck, cpu, p, out=lines.append)
    assert lines[-1] == "verify: FAIL"
    flagged = [line for line in lines if "beyond tolerance" in line]
    assert flagged and flagged[0].split()[0] == str(layer)


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
