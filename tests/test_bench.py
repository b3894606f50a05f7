"""`clefcore bench`: its numpy check of every timed op, provenance, GEMM routes, the image case and the
transformers peer; on a GPU the kernel table, a wrong kernel stopping it, and runs without cuBLAS."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import types
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from gpu_only import HAVE_CUBLAS, HAVE_FP8, HAVE_MMA, MARKS

import clefcore
from clefcore import images
from clefcore.bench import end_to_end, image, kernels, peers, provenance, records, weights
from clefcore.backends.cpu import CpuOps
from clefcore.backends.cuda.matmul import shape_key
from clefcore.checkpoint import Checkpoint
from clefcore.config import read_json
from clefcore.encode import mrope_positions
from clefcore.errors import DeviceError
from clefcore.kernel_select import GemmRoute
from clefcore.model import vision
from clefcore.model.head import HeadLayout
from clefcore.model.params import load_params
from clefcore.synth import picture_png

cupy = pytest.importorskip("cupy")


def gpu(test):
    for mark in MARKS:
        test = mark(test)
    return test


def test_check_records_within_the_bound_and_stops_beyond_it():
    ref = np.array([[1.0, -2.0], [0.5, 4.0]])
    checks = {}
    kernels._check("close", ref + 1e-6, ref, 1e-6, checks)       # 1e-6 of a max |ref| of 4
    assert checks == {"close": pytest.approx(2.5e-7)}
    with pytest.raises(DeviceError, match=r"far: max .* = 2\.500e-01 against numpy, more than 1e-03"):
        kernels._check("far", ref + np.array([[0.0, 0.0], [0.0, 1.0]]), ref, 1e-3, checks)
    with pytest.raises(DeviceError, match="nan"):
        kernels._check("nan", np.where(ref > 3, np.nan, ref), ref, 1e-3, checks)
    assert list(checks) == ["close"]
    assert kernels.tol_k(2e-5, 1000) == 2e-5 and kernels.tol_k(2e-5, 12288) == pytest.approx(6e-5)


def test_provenance_names_the_code_that_ran(tmp_path, monkeypatch):
    p = provenance.code()
    assert p["version"] == clefcore.__version__ and re.fullmatch("[0-9a-f]{12}", p["sources"]), p
    monkeypatch.chdir(tmp_path)                  # git is asked about the package's own checkout, not the cwd's
    assert provenance.code() == p
    a, b = tmp_path / "a.cu", tmp_path / "b.cu"
    a.write_text("x = 1;")
    b.write_text("y = 2;")
    before = provenance._fingerprint([("a.cu", a), ("b.cu", b)])
    assert provenance._fingerprint([("b.cu", b), ("a.cu", a)]) == before       # order of listing does not matter
    a.write_text("x = 3;")
    assert provenance._fingerprint([("a.cu", a), ("b.cu", b)]) != before       # one changed byte does


def test_route_counts_per_case():
    """A case's {shape key: route} (as CudaOps.gemm_routes records it) as the report gives it: shapes per route,
    most used first."""
    seen = {shape_key(346, 12288, 4096, "float32", "fp16"): GemmRoute.WMMA,
            shape_key(346, 4096, 12288, "float32", "fp16"): GemmRoute.CUBLAS,
            shape_key(346, 24576, 4096, "swiglu", "fp16"): GemmRoute.WMMA,
            shape_key(11, 1024, 4096, "float32", "fp16"): GemmRoute.ROWS}
    assert list(end_to_end.route_counts(seen).items()) == [("wmma", 2), ("cublas", 1), ("rows", 1)]
    assert end_to_end._routes_text(end_to_end.route_counts(seen)) == "GEMM wmma 2, cublas 1, rows 1 shapes"
    assert end_to_end.route_counts({}) == {}
    assert end_to_end._routes_text({}) == "GEMM routes unseen (CUDA graph replayed)"
    # keys are per M bucket: 300 and 512 rows share one, 513 does not
    k300, k512, k513, k1 = (shape_key(M, 64, 64, "t", "split") for M in (300, 512, 513, 1))
    assert k300 == k512 == (64, 64, 512, "t", "split") and k513[2] == 1024 and k1[2] == 16


@pytest.mark.parametrize("lens", [[346], [200], [160, 160], [300, 140], [129], [512] * 4])
def test_the_breakdowns_series_is_one_schema_with_other_states(lens):
    """--breakdown's requests (end_to_end.state_series): the first of the case's own lengths, then others whose
    states are shorter by distinct numbers of tokens while the case leaves room, the total within the case's
    128-token bucket, fresh tokens each: one key of the head's graphs (the schema and the bucket) for them all,
    and never one stream twice."""
    rng = np.random.default_rng(0)
    series = end_to_end.state_series(lens, 128, 6, 1000, rng)
    totals = [sum(len(r.input_ids) for r in s) for s in series]
    assert len(series) == 6 and [len(r.input_ids) for r in series[0]] == lens
    T = sum(lens)
    room = min((T - 1) % 128, sum(max(0, L - records.QUESTION_TOKENS) for L in lens))
    assert all(T - room <= t <= T for t in totals) and (T - 1) // 128 == (min(totals) - 1) // 128
    assert len(set(totals)) == min(6, room + 1)
    keys = set()
    for s in series:
        cu = np.concatenate([[0], np.cumsum([len(r.input_ids) for r in s])])
        keys.add(HeadLayout(cu, [r.questions for r in s], 0, -(-T // 128) * 128).key)
        assert all(q.option_spans[-1][1] < len(r.input_ids) for r in s for q in r.questions)
    assert len(keys) == 1
    ids = [np.concatenate([r.input_ids for r in s]) for s in series]
    assert all(not np.array_equal(a[:100], b[:100]) for a, b in zip(ids, ids[1:]))   # fresh tokens each


NO_CUBLAS = Path(__file__).parent / "no_cublas"
MODEL = Path(__file__).parent / "golden" / "model"


def _no_cublas_child(args, cwd, timeout):
    """``python args`` with cuBLAS made unloadable (tests/no_cublas's sitecustomize on PYTHONPATH), run outside
    the repo root so that it imports the clefcore this test imports."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(NO_CUBLAS)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                            if p])
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def test_gemm_libraries_say_why_cublas_is_missing(tmp_path):
    """The JSON's "cublas" / "cublaslt" in a process that cannot load cuBLAS (no GPU needed): the shim's refusal
    where the libraries exist, CuPy's "not found" where they do not (this CPU machine)."""
    code = "import json; from clefcore.bench import provenance; print(json.dumps(provenance.gemm_libraries()))"
    r = _no_cublas_child(["-c", code], tmp_path, 120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    why = got["cublas"]["error"]
    assert got["cublas"]["loadable"] is False and ("tests/no_cublas" in why or "libcublas" in why), got
    assert got["cublaslt"] == {"loadable": False, "error": f"comes with cuBLAS, which cannot be loaded: {why}"}


SMALL = dict(gemm_shapes=((65, 144, 256), (1, 48, 512)), head_gemm=(3, 130, 1024), seq_lens=(130,))


@pytest.fixture(scope="module")
def ops():
    from clefcore.backends.cuda import CudaOps
    return CudaOps(0, precision="exact")


@gpu
def test_kernel_table_checks_every_timed_op(ops):
    """Every row's op checked first; the cuBLAS rows only where cuBLAS loads (run the suite under
    PYTHONPATH=tests/no_cublas for the other half)."""
    out = {"precision": ops.plan.path}
    rows = kernels.table(cupy, ops, out, **SMALL)
    names = set()
    for M, N, K in SMALL["gemm_shapes"]:
        names |= {f"wmma fp16 {M}x{N}x{K}", f"wmma split {M}x{N}x{K}"}
        if HAVE_CUBLAS:
            names |= {f"cuBLAS fp16 {M}x{N}x{K}", f"cuBLAS split {M}x{N}x{K}"}
        if HAVE_FP8 and HAVE_CUBLAS and ops.twins.gemm.supports(M, N, K):
            names.add(f"cuBLAS(Lt) split8 {M}x{N}x{K}")
        if HAVE_MMA and K % 8 == 0:
            names.add(f"mma fp16 {M}x{N}x{K}")
    M, N, K = SMALL["head_gemm"]
    names |= {f"gemm_rows {M}x{N}x{K}", f"wmma {ops.plan.path} {M}x{N}x{K}"}
    if HAVE_CUBLAS:
        names.add(f"cuBLAS split {M}x{N}x{K}")
    for T in SMALL["seq_lens"]:
        names |= {f"{op} T={T}" for op in ("attention", "gated delta rule", "add_rmsnorm", "conv1d+silu")}
    assert set(out["checks"]) == names                  # every timed op was checked first
    assert len(rows) == len(out["kernels"]) and all(r["ms"] > 0 for r in out["kernels"])
    assert any("cuBLAS" in r["name"] for r in out["kernels"]) == HAVE_CUBLAS
    assert ("kernels_note" in out) == (not HAVE_CUBLAS)


@gpu
def test_gemm_routes_records_each_shapes_route_within_the_block(ops):
    """ops.gemm_routes: the route of each GEMM issued inside the block, keyed as the autotune keys it, equal to
    the autotune's choice; nothing after the block; the method is the class's again."""
    x1 = cupy.random.standard_normal((300, 256), dtype=cupy.float32)
    x2 = cupy.random.standard_normal((5, 256), dtype=cupy.float32)
    w = (cupy.random.standard_normal((192, 256), dtype=cupy.float32) * 0.02).astype(cupy.float16)
    with ops.gemm_routes() as seen:
        ops.linear(x1, w)
        ops.linear(x2, w)
        ops.linear(x1[:280], w)                          # the same bucket as 300 rows: one key
    keys = [shape_key(300, 192, 256, "float32", ops.plan.path), shape_key(5, 192, 256, "float32", ops.plan.path)]
    assert list(seen) == keys and seen == {k: ops.gemm.chosen[k] for k in keys}
    own = {GemmRoute.WMMA, GemmRoute.ROWS}
    assert set(seen.values()) <= (own | {GemmRoute.CUBLAS} if HAVE_CUBLAS else own)
    assert "choose" not in vars(ops.matmul)
    ops.linear(cupy.random.standard_normal((1000, 256), dtype=cupy.float32), w)
    assert list(seen) == keys


@gpu
def test_bench_without_cublas_runs_on_its_own_gemms(tmp_path):
    """The kernel table (small shapes) and `clefcore bench` end to end (the tiny golden model, fast and exact)
    in a process that cannot load cuBLAS: both complete; no cuBLAS row; the JSON says cuBLAS and cuBLASLt are not
    loadable; every case's GEMMs ran on clefcore's own kernels: wmma, gemm_rows, and gemm_mma.cu on sm_80+."""
    table, report = tmp_path / "kernels.json", tmp_path / "bench.json"
    script = (f"import json, sys, cupy\nfrom clefcore import bench\nfrom clefcore.backends.cuda import CudaOps\n"
              f"out = {{}}\nbench.kernels.table(cupy, CudaOps(0, precision='fast'), out, **{SMALL!r})\n"
              f"json.dump(out, open({str(table)!r}, 'w'))\nsys.exit(bench.main(sys.argv[1:]))\n")
    r = _no_cublas_child(["-c", script, "--model", str(MODEL), "--precision", "fast,exact", "--lengths", "200",
                          "--packed", "2x160", "--reps", "1", "--no-kernels", "--no-transformers",
                          "--breakdown", "200", "--json", str(report)], tmp_path, 900)
    print(r.stdout[-5000:])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    kt = json.loads(table.read_text())
    names = [k["name"] for k in kt["kernels"]]
    assert not any("cuBLAS" in n for n in names + list(kt["checks"])), names
    assert sum(n.startswith("wmma GEMM") for n in names) == 2 * len(SMALL["gemm_shapes"])
    assert any(n.startswith("gemm_rows") for n in names) and "tests/no_cublas" in kt["kernels_note"]
    own = {"wmma", "rows", "mma"} if HAVE_MMA else {"wmma", "rows"}
    got = json.loads(report.read_text())
    assert got["cublas"]["loadable"] is False and "tests/no_cublas" in got["cublas"]["error"]
    assert got["cublaslt"]["loadable"] is False
    assert got["paths"] == {"fast": "fp16", "exact": "split"}
    assert "cuBLAS not loadable" in r.stdout
    for prec, cases in got["end_to_end"].items():
        assert [c["case"] for c in cases] == ["200 tokens", "2x160 packed"]
        # --breakdown 200: the 200-token case, not the 320-token packed one; the head's launches end before it does
        parts = cases[0]["breakdown"]
        assert "breakdown" not in cases[1] and set(parts) == {"backbone_ms", "head_ms", "head_launch_ms",
                                                              "head_graph_replays", "series_tokens"}
        # the case's own runs saw its schema and bucket first: every timed run of the series replays the head
        assert parts["head_graph_replays"] == len(parts["series_tokens"])
        assert len(parts["series_tokens"]) == 1 and 128 < parts["series_tokens"][0] < 200   # --reps 1: one, cut
        assert 0 < parts["head_launch_ms"] <= parts["head_ms"] and parts["backbone_ms"] > 0, parts
        for c in cases:
            # the tiny model's fp32-operand GEMMs have only wmma among clefcore's kernels, so a run without cuBLAS
            # shows wmma shapes; fp16 operands may take gemm_mma.cu, the head's few-row GEMMs gemm_rows
            assert c["gemm_routes"].get("wmma", 0) > 0 and set(c["gemm_routes"]) <= own, (prec, c)
            assert "gemm_paths" not in c
        assert set(got["gemm_choice"][prec].values()) <= own
    lines = [line for line in r.stdout.splitlines() if line.startswith("  clefcore ")]   # each case's line says it
    assert len(lines) == 4 and all(re.search(r"; GEMM (.*, )?wmma \d+", line) and "cublas" not in line
                                   for line in lines), lines


@gpu
def test_a_wrong_kernel_stops_the_bench(ops, monkeypatch):
    monkeypatch.setattr(ops.matmul, "gemm_rows", lambda x, w, o, bias=None: o.fill(0))
    with pytest.raises(DeviceError, match="gemm_rows 3x130x1024: max .* = 1.000e\\+00"):
        kernels.table(cupy, ops, {"precision": ops.plan.path}, **SMALL)


# ------------------------------------------------------------------------------------------------ the image case

IMAGES_MODEL = Path(__file__).parent / "golden_images" / "model"


@pytest.fixture(scope="module")
def tiny_with_tower():
    ck, cpu = Checkpoint(IMAGES_MODEL), CpuOps()
    params = load_params(ck, cpu)
    vp, why = vision.attach(ck, cpu, params)
    assert vp is not None, why
    return ck, params, vp


def test_image_record_is_the_engines_layout_and_its_run_decodes_each_time(tiny_with_tower):
    """The bench's image request without a tokenizer: 32 text tokens, the image's pads, 224 text tokens; M-RoPE
    positions as the encoder makes them; runs from the PNG bytes and from the decoded RGB answer as a run from its
    pixels."""
    _, params, vp = tiny_with_tower
    cpu = CpuOps()
    data = picture_png(64, 48)                          # -> 320x224: 14 x 20 patches, 70 image tokens
    rec, px = records.image_record(data, params.text.vocab_size)
    assert px.grid_thw == (1, 14, 20) and rec.image_spans == ((32, 102, 7, 10),)
    assert len(rec.input_ids) == 32 + 70 + 224 and rec.questions[0].question_span[0] >= 102
    assert np.array_equal(rec.positions, mrope_positions(326, rec.image_spans))
    from_bytes = end_to_end.forward_run(cpu, params, [rec], vp, data)()
    from_rgb = end_to_end.forward_run(cpu, params, [rec], vp, images.decode(data, 0))()
    from_pixels = end_to_end.forward_run(cpu, params, [replace(rec, images=(px,))], vp)()
    text_only = end_to_end.forward_run(cpu, params, [records.record(rec.input_ids)])()
    for a, c, b, t in zip(from_bytes[0], from_rgb[0], from_pixels[0], text_only[0]):
        assert np.array_equal(a, b) and np.array_equal(c, b) and not np.allclose(a, t)


def test_image_size_argument():
    assert image.parse_size("1024x1024") == (1024, 1024) and image.parse_size("640X480") == (640, 480)
    for bad in ("1024", "0x5", "axb", "-3x4"):
        with pytest.raises(SystemExit, match="expected WxH"):
            image.parse_size(bad)


def test_transformers_image_peer_runs_the_same_request(tiny_with_tower):
    """The transformers side of the image case at the tiny shapes, on the CPU (the bench runs it on the GPU):
    the request is accepted (the pad count matches its processor's grid) and both times are recorded."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    ck, params, vp = tiny_with_tower
    cfg = vision.VisionConfig.from_dict(read_json(IMAGES_MODEL / "config.json")["vision_config"])
    out = {}
    peers.transformers_image_side(ck.text, cfg, params.mrope_section, (64, 48), 1, out, device="cpu")
    got = out["transformers_image"]
    assert isinstance(got, dict), got
    assert got["image_tokens"] == 70 and got["tokens"] == 326 and got["image_ms"] > 0 and got["text_ms"] > 0


@gpu
def test_image_case_on_the_gpu(tiny_with_tower):
    """image.case at the tiny shapes: both requests measured, the parts timed, the ratio recorded."""
    from clefcore.model import vision
    from clefcore.backends.cuda import CudaOps
    from clefcore.model.params import load_params
    ck = tiny_with_tower[0]
    ops = CudaOps(0, precision="exact")
    params = load_params(ck, ops)
    vp, why = vision.attach(ck, ops, params)
    assert vp is not None, why
    r = image.case(cupy, ops, params, vp, (64, 48), 2)
    assert r["image_tokens"] == 70 and r["tokens"] == 326 and r["patches"] == 280
    assert r["ratio"] == pytest.approx(r["image_ms"] / r["text_ms"])
    assert r["ratio_fastest"] == pytest.approx(min(r["runs_ms"]["image"]) / min(r["runs_ms"]["text"]))
    assert r["within_target"] == (max(r["ratio"], r["ratio_fastest"]) <= 1.5)
    assert r["ratio_with_decode"] == pytest.approx(r["image_png_ms"] / r["text_ms"])
    assert r["image_case"]["tokens"] == r["image_png_case"]["tokens"] == r["text_case"]["tokens"] == 326
    assert all(len(v) == image.ROUNDS for v in r["runs_ms"].values())
    assert r["decode_ms"] > 0 and r["preprocess_ms"] > 0 and r["tower_ms"] > 0


@gpu
def test_random_tower_has_the_release_shapes():
    from clefcore.model import vision
    from clefcore.backends.cuda import CudaOps
    from clefcore.synth import config_json
    cfg = vision.VisionConfig.from_dict(config_json("clef-flash", vision=True)["vision_config"])
    vp = weights.random_vision_params(cupy, CudaOps(0, precision="fast"), cfg)
    assert vp.w["patch_embed.proj.weight"].shape == (1152, 1536) and vp.w["pos_embed.weight"].dtype == np.float32
    n = sum(int(np.prod(w.shape)) for w in vp.w.values())
    assert n == 456_010_480                   # qwen35-backbone.md §2: model.visual.*, 456,010,480 parameters


def _fake_fla(monkeypatch, torch):
    """A stand-in for flash-linear-attention's causal conv (its interface: x [B, T, D], weight [D, K] ->
    (y [B, T, D], final state)), computed with torch on the CPU, and a find_spec that sees it."""
    def causal_conv1d(x, weight, bias=None, activation=None, **_):
        K = weight.shape[1]
        xp = torch.nn.functional.pad(x.transpose(1, 2), (K - 1, 0))
        y = torch.nn.functional.conv1d(xp, weight[:, None, :], bias, groups=weight.shape[0]).transpose(1, 2)
        return (torch.nn.functional.silu(y) if activation in ("silu", "swish") else y), None

    mod = types.ModuleType("fla.modules.causal_conv1d")
    mod.causal_conv1d = causal_conv1d
    for name in ("fla", "fla.modules"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.modules.causal_conv1d", mod)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: (object() if n == "fla" else None if n == "causal_conv1d" else real(n, *a)))


def test_peer_conv_routes_transformers_conv_through_fla_and_restores_it(monkeypatch):
    """With flash-linear-attention importable and no causal_conv1d package, the peer's conv goes through FLA's
    kernel while the context is open (same output as transformers' own reference conv, on random inputs of an odd
    length), the variant says so, and transformers' function is back afterwards."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    _fake_fla(monkeypatch, torch)
    reference = modeling.causal_conv1d_fn
    x, w = torch.randn(2, 24, 37), torch.randn(24, 4)
    want = reference(x, w, None, activation="silu")
    with peers.peer_conv(transformers) as variant:
        assert modeling.causal_conv1d_fn is not reference
        got = modeling.causal_conv1d_fn(x, w, None, activation="silu")
    assert modeling.causal_conv1d_fn is reference
    assert "conv: flash-linear-attention" in variant
    assert got.shape == want.shape == (2, 24, 37)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_peer_conv_says_when_no_fused_conv_is_installed(monkeypatch):
    """Without either package the peer keeps transformers' reference conv and says so."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n in ("fla", "causal_conv1d") else real(n, *a))
    before = modeling.causal_conv1d_fn
    with peers.peer_conv(transformers) as variant:
        assert modeling.causal_conv1d_fn is before
    assert "conv: torch reference" in variant
