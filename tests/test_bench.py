"""`clefcore bench`'s kernel table checks every op against numpy before timing it: the check itself (no GPU),
then on a GPU the whole table at small, awkward shapes with each check recorded, and a kernel that writes wrong
values stopping the bench instead of being reported as fast."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from gpu_only import HAVE_CUBLAS, HAVE_FP8, MARKS  # noqa: E402

from clefcore import bench, peers  # noqa: E402
from clefcore.errors import DeviceError  # noqa: E402

cupy = pytest.importorskip("cupy")


def gpu(test):
    for mark in MARKS:
        test = mark(test)
    return test


def test_check_records_within_the_bound_and_stops_beyond_it():
    ref = np.array([[1.0, -2.0], [0.5, 4.0]])
    checks = {}
    bench._check("close", ref + 1e-6, ref, 1e-6, checks)       # 1e-6 of a max |ref| of 4
    assert checks == {"close": pytest.approx(2.5e-7)}
    with pytest.raises(DeviceError, match=r"far: max .* = 2\.500e-01 against numpy, more than 1e-03"):
        bench._check("far", ref + np.array([[0.0, 0.0], [0.0, 1.0]]), ref, 1e-3, checks)
    with pytest.raises(DeviceError, match="nan"):
        bench._check("nan", np.where(ref > 3, np.nan, ref), ref, 1e-3, checks)
    assert list(checks) == ["close"]
    assert bench.tol_k(2e-5, 1000) == 2e-5 and bench.tol_k(2e-5, 12288) == pytest.approx(6e-5)


def test_provenance_names_the_code_that_ran(tmp_path, monkeypatch):
    import clefcore
    p = bench.provenance()
    assert p["version"] == clefcore.__version__ and re.fullmatch("[0-9a-f]{12}", p["sources"]), p
    monkeypatch.chdir(tmp_path)                  # git is asked about the package's own checkout, not the cwd's
    assert bench.provenance() == p
    a, b = tmp_path / "a.cu", tmp_path / "b.cu"
    a.write_text("x = 1;")
    b.write_text("y = 2;")
    before = bench._fingerprint([("a.cu", a), ("b.cu", b)])
    assert bench._fingerprint([("b.cu", b), ("a.cu", a)]) == before            # order of listing does not matter
    a.write_text("x = 3;")
    assert bench._fingerprint([("a.cu", a), ("b.cu", b)]) != before            # one changed byte does


SMALL = dict(gemm_shapes=((65, 144, 256), (1, 48, 512)), head_gemm=(3, 130, 1024), seq_lens=(130,))


@pytest.fixture(scope="module")
def ops():
    from clefcore.backends.cuda import CudaOps
    if not HAVE_CUBLAS:
        pytest.skip("the kernel table times cuBLAS as its ceiling; cuBLAS cannot be loaded here")
    return CudaOps(0, precision="exact")


@gpu
def test_kernel_table_checks_every_timed_op(ops):
    out = {"precision": ops.precision}
    rows = bench.kernels(cupy, ops, out, **SMALL)
    names = set()
    for M, N, K in SMALL["gemm_shapes"]:
        names |= {f"{p} {M}x{N}x{K}" for p in ("cuBLAS fp16", "cuBLAS split", "wmma fp16", "wmma split")}
        if HAVE_FP8 and ops._fp8.supports(M, N, K):
            names.add(f"cuBLAS(Lt) split8 {M}x{N}x{K}")
    M, N, K = SMALL["head_gemm"]
    names |= {f"gemm_rows {M}x{N}x{K}", f"wmma {ops.precision} {M}x{N}x{K}", f"cuBLAS split {M}x{N}x{K}"}
    for T in SMALL["seq_lens"]:
        names |= {f"{op} T={T}" for op in ("attention", "gated delta rule", "add_rmsnorm", "conv1d+silu")}
    assert set(out["checks"]) == names                  # every timed op was checked first
    assert len(rows) == len(out["kernels"]) and all(r["ms"] > 0 for r in out["kernels"])


@gpu
def test_a_wrong_kernel_stops_the_bench(ops, monkeypatch):
    monkeypatch.setattr(ops, "_gemm_rows", lambda x, w, o, bias=None: o.fill(0))
    with pytest.raises(DeviceError, match="gemm_rows 3x130x1024: max .* = 1.000e\\+00"):
        bench.kernels(cupy, ops, {"precision": ops.precision}, **SMALL)


# ------------------------------------------------------------------------------------------------ the image case

IMAGES_MODEL = Path(__file__).parent / "golden_images" / "model"


@pytest.fixture(scope="module")
def tiny_with_tower():
    from clefcore import model, vision
    from clefcore.backends import cpu
    from clefcore.checkpoint import Checkpoint
    ck = Checkpoint(IMAGES_MODEL)
    params = model.load_params(ck, cpu)
    vp, why = vision.attach(ck, cpu, params)
    assert vp is not None, why
    return ck, params, vp


def test_image_record_is_the_engines_layout_and_its_run_decodes_each_time(tiny_with_tower):
    """The bench's image request without a tokenizer: 32 text tokens, the image's pads, 224 text tokens; M-RoPE
    positions as the encoder makes them; runs from the PNG bytes and from the decoded RGB answer as a run from its
    pixels."""
    from dataclasses import replace

    from clefcore import images
    from clefcore.backends import cpu
    from clefcore.encode import mrope_positions
    from clefcore.synth import picture_png
    _, params, vp = tiny_with_tower
    data = picture_png(64, 48)                          # -> 320x224: 14 x 20 patches, 70 image tokens
    rec, px = bench.image_record(data, params.text.vocab_size)
    assert px.grid_thw == (1, 14, 20) and rec.image_spans == ((32, 102, 7, 10),)
    assert len(rec.input_ids) == 32 + 70 + 224 and rec.questions[0].question_span[0] >= 102
    assert np.array_equal(rec.positions, mrope_positions(326, rec.image_spans))
    from_bytes = bench.forward_run(cpu, params, [rec], vp, data)()
    from_rgb = bench.forward_run(cpu, params, [rec], vp, images.decode(data, 0))()
    from_pixels = bench.forward_run(cpu, params, [replace(rec, images=(px,))], vp)()
    text_only = bench.forward_run(cpu, params, [bench._record(rec.input_ids)])()
    for a, c, b, t in zip(from_bytes[0], from_rgb[0], from_pixels[0], text_only[0]):
        assert np.array_equal(a, b) and np.array_equal(c, b) and not np.allclose(a, t)


def test_image_size_argument():
    assert bench._image_size("1024x1024") == (1024, 1024) and bench._image_size("640X480") == (640, 480)
    for bad in ("1024", "0x5", "axb", "-3x4"):
        with pytest.raises(SystemExit, match="expected WxH"):
            bench._image_size(bad)


def test_transformers_image_peer_runs_the_same_request(tiny_with_tower):
    """The transformers side of the image case at the tiny shapes, on the CPU (the bench runs it on the GPU):
    the request is accepted (the pad count matches its processor's grid) and both times are recorded."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from clefcore import vision
    from clefcore.config import read_json
    ck, params, vp = tiny_with_tower
    cfg = vision.VisionConfig.from_dict(read_json(IMAGES_MODEL / "config.json")["vision_config"])
    out = {}
    peers.transformers_image_side(ck.text, cfg, params.mrope_section, (64, 48), 1, out, device="cpu")
    got = out["transformers_image"]
    assert isinstance(got, dict), got
    assert got["image_tokens"] == 70 and got["tokens"] == 326 and got["image_ms"] > 0 and got["text_ms"] > 0


@gpu
def test_image_case_on_the_gpu(tiny_with_tower):
    """bench.image_case at the tiny shapes: both requests measured, the parts timed, the ratio recorded."""
    from clefcore import model, vision
    from clefcore.backends.cuda import CudaOps
    ck = tiny_with_tower[0]
    ops = CudaOps(0, precision="exact")
    params = model.load_params(ck, ops)
    vp, why = vision.attach(ck, ops, params)
    assert vp is not None, why
    r = bench.image_case(cupy, ops, params, vp, (64, 48), 2)
    assert r["image_tokens"] == 70 and r["tokens"] == 326 and r["patches"] == 280
    assert r["ratio"] == pytest.approx(r["image_ms"] / r["text_ms"])
    assert r["ratio_fastest"] == pytest.approx(min(r["runs_ms"]["image"]) / min(r["runs_ms"]["text"]))
    assert r["within_target"] == (max(r["ratio"], r["ratio_fastest"]) <= 1.5)
    assert r["ratio_with_decode"] == pytest.approx(r["image_png_ms"] / r["text_ms"])
    assert r["image_case"]["tokens"] == r["image_png_case"]["tokens"] == r["text_case"]["tokens"] == 326
    assert all(len(v) == bench.IMAGE_ROUNDS for v in r["runs_ms"].values())
    assert r["decode_ms"] > 0 and r["preprocess_ms"] > 0 and r["tower_ms"] > 0


@gpu
def test_random_tower_has_the_release_shapes():
    from clefcore import vision
    from clefcore.backends.cuda import CudaOps
    from clefcore.synth import config_json
    cfg = vision.VisionConfig.from_dict(config_json("clef-flash", vision=True)["vision_config"])
    vp = bench.random_vision_params(cupy, CudaOps(0, precision="fast"), cfg)
    assert vp.w["patch_embed.proj.weight"].shape == (1152, 1536) and vp.w["pos_embed.weight"].dtype == np.float32
    n = sum(int(np.prod(w.shape)) for w in vp.w.values())
    assert n == 456_010_480                   # qwen35-backbone.md §2: model.visual.*, 456,010,480 parameters
