"""`clefcore bench`'s kernel table checks every op against numpy before timing it: at small, awkward shapes the
whole table runs and each check is recorded; a kernel that writes wrong values stops the bench instead of being
reported as fast."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from gpu_only import HAVE_FP8, MARKS  # noqa: E402

from clefcore import bench  # noqa: E402
from clefcore.errors import DeviceError  # noqa: E402

pytestmark = MARKS
cupy = pytest.importorskip("cupy")

SMALL = dict(gemm_shapes=((65, 144, 256), (1, 48, 512)), head_gemm=(3, 130, 1024), seq_lens=(130,))


@pytest.fixture(scope="module")
def ops():
    from clefcore.backends.cuda import CudaOps
    return CudaOps(0, precision="split8" if HAVE_FP8 else "split")


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


def test_a_wrong_kernel_stops_the_bench(ops, monkeypatch):
    monkeypatch.setattr(ops, "_gemm_rows", lambda x, w, o, bias=None: o.fill(0))
    with pytest.raises(DeviceError, match="gemm_rows 3x130x1024: max .* = 1.000e\\+00"):
        bench.kernels(cupy, ops, {"precision": ops.precision}, **SMALL)
