"""The golden fixtures (Cloudflare's reference + transformers, fp32) through the CLI and the API. Tolerances
are the fixture README's: logits 2e-4 absolute; hidden states 1e-4 relative per layer; response numbers 1e-4
(last-digit rounding ties); ids, spans, option ids and error texts exact."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import clefcore
from clefcore.jsonvalue import parse_body
from clefcore.preparer import Preparer

GOLDEN = Path(__file__).parent / "golden"
MODEL = GOLDEN / "model"
REQUESTS = (GOLDEN / "requests.jsonl").read_bytes().splitlines()
EXPECTED = [json.loads(line) for line in (GOLDEN / "expected.jsonl").read_text(encoding="utf-8").splitlines()]


def clefcore_command() -> list[str]:
    exe = shutil.which("clefcore")
    return [exe] if exe else [sys.executable, "-m", "clefcore.cli"]


def rel(got, want) -> float:
    """max |got - want| / max |want|: the fixtures' relative measure for hidden states."""
    return float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())


def assert_same_response(got, want, path="response"):
    """Structure, keys, key order and strings exact; numbers within 1e-4."""
    if isinstance(want, dict):
        assert isinstance(got, dict), path
        assert list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_same_response(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_response(g, w, f"{path}[{i}]")
    elif isinstance(want, float) or (isinstance(want, int) and not isinstance(want, bool)
                                     and isinstance(got, float)):
        # both are 4-decimal values: compare the decimal difference (0.3687 - 0.3686 is 1.00000000000004e-4)
        assert round(abs(got - want), 9) <= 1e-4, f"{path}: {got} vs {want}"
    else:
        assert got == want and type(got) is type(want), f"{path}: {got!r} vs {want!r}"


def check_cli_against_fixture(model, body: bytes, fx: dict, tmp_path, timeout: float = 120):
    """`clefcore decide --debug` on the CPU with the reference's confidence and validation, against one fixture row:
    its error text (exit 2), or its ids, spans, option ids, logits (2e-4) and response. Returns the bare output."""
    req = tmp_path / "request.json"
    req.write_bytes(body)
    cmd = clefcore_command() + ["decide", "--model", str(model), "--device", "cpu", "--debug",
                                "--confidence", "reference", "--validation", "reference",
                                "--context-length", str(fx["max_length"]), str(req)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONIOENCODING="utf-8"))
    out = json.loads(proc.stdout)
    if "error" in fx:
        assert proc.returncode == 2, proc.stderr
        assert out["error"]["message"] == fx["error"]
        return out
    assert proc.returncode == 0, proc.stderr
    debug = out.pop("debug")
    assert debug["input_ids"] == fx["input_ids"]
    for got, want in zip(debug["questions"], fx["questions"], strict=True):
        assert (got["id"], got["question_span"], got["option_ids"], got["option_spans"]) == \
            (want["id"], want["question_span"], want["option_ids"], want["option_spans"])
        np.testing.assert_allclose(got["logits"], want["logits"], rtol=0, atol=2e-4)
    assert_same_response(out, fx["response"])
    return out


@pytest.mark.parametrize("fx", EXPECTED, ids=[e["name"] for e in EXPECTED])
def test_cli_reproduces_fixture(fx, tmp_path):
    check_cli_against_fixture(MODEL, REQUESTS[fx["index"]], fx, tmp_path)


@pytest.fixture(scope="module")
def engine():
    return clefcore.load(MODEL, device="cpu", confidence="reference", validation="reference")


STATE_FIXTURES = [e for e in EXPECTED if (GOLDEN / "states" / Path(e.get("states_file", "-")).name).is_file()]


@pytest.mark.parametrize("fx", STATE_FIXTURES, ids=[e["name"] for e in STATE_FIXTURES])
def test_every_layer_matches(fx, engine):
    ref = load_file(GOLDEN / "states" / Path(fx["states_file"]).name)
    host = Preparer(engine.checkpoint, fx["max_length"], "reference", engine.images_refused)
    prepared = host.prepare(parse_body(REQUESTS[fx["index"]]))
    np.testing.assert_array_equal(prepared.record.input_ids, ref["input_ids"])
    _, hs, layers = engine.forward([prepared.record], keep_layers=True)
    # the fixture's last layer entry is the residual stream before the final norm, like ours
    for i, (got, want) in enumerate(zip(layers, ref["layer_outputs"])):
        assert (r := rel(got, want)) <= 1e-4, f"layer {i}: max |diff| / max |value| = {r:.2e}"
    assert (r := rel(hs, ref["last_hidden_state"])) <= 1e-4, f"final norm output: {r:.2e}"


def test_packed_batch_equals_one_by_one(engine):
    """decide_many runs one packed forward; every answer must equal its single-request answer."""
    bodies = [parse_body(REQUESTS[fx["index"]]) for fx in EXPECTED if "error" not in fx and fx["max_length"] == 16384]
    singles = [engine.prepare(b) for b in bodies]
    packed, _, _ = engine.forward([p.record for p in singles])
    for p, z_packed in zip(singles, packed):
        (z_single,), _, _ = engine.forward([p.record])
        for a, b in zip(z_packed, z_single):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
    # GEMMs over a longer stream sum in another order, so a rounded value may flip its last digit
    for got, want in zip(engine.decide_many(bodies), [engine.decide(b) for b in bodies]):
        assert_same_response(got, want)


def test_gpu_options_are_refused_on_the_cpu(tmp_path):
    """--precision / --gemm / --token-block tune the CUDA backend; on the CPU they would be silently ignored, so the
    engine refuses them with a message naming them."""
    req = tmp_path / "request.json"
    req.write_bytes(REQUESTS[EXPECTED[0]["index"]])
    cmd = clefcore_command() + ["decide", "--model", str(MODEL), "--device", "cpu", "--precision", "fp16",
                                "--gemm", "cublas", "--token-block", "64", str(req)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == "clefcore decide: gemm, precision, token_block: GPU-only options (device is 'cpu')\n"
