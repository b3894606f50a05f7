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

from clefcore import bench  # noqa: E402
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
