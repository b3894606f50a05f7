"""The numpy studies under docs/studies keep running against the package: each emulation, roundings off,
reproduces the golden fixtures; with fast's roundings it lands inside fast's contract."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "studies"))
ml_dtypes = pytest.importorskip("ml_dtypes")

import fast_error_sources  # noqa: E402
import fp8_gemm  # noqa: E402
import gdn_wy_precision  # noqa: E402
import golden_runs  # noqa: E402
from clefcore.backends import cpu  # noqa: E402

pytestmark = pytest.mark.slow


def worst(gold: Path, ops) -> tuple[float, list]:
    m, probs = fp8_gemm.run(gold, ops)
    return max(float(np.max(np.abs(p - r))) for p, r in zip(probs, m.reference, strict=True)), probs


def test_fast_error_sources_with_no_family_rounded_is_numpy_and_with_all_within_fast():
    none, every = fast_error_sources.errors(set()), fast_error_sources.errors(set(fast_error_sources.FAMILIES))
    assert none[0] < 1e-5
    assert 1e-4 < every[0] < 1e-2


@pytest.mark.parametrize("name", ["text", "images"])
def test_fast_emulation_and_its_fp8_variant_on_each_golden_set(name):
    gold = golden_runs.SETS[name]
    off, _ = worst(gold, gdn_wy_precision.FastEmulation(cpu.gated_delta_rule, fast=False))
    assert off < 1e-5
    fast, fast_p = worst(gold, fp8_gemm.Fp8Emulation())
    assert 1e-4 < fast < 1e-2
    # one family in fp8: the emulation reaches those GEMMs (it moves the answers off fast's)
    scheme = fp8_gemm.SCHEMES["a: weights per output channel, activations per token"]
    _, fp8_p = worst(gold, fp8_gemm.Fp8Emulation(scheme, frozenset({"mlp_down"})))
    assert max(float(np.max(np.abs(p - f))) for p, f in zip(fp8_p, fast_p)) > 1e-3


@pytest.mark.parametrize("block", [(1, None), (None, None), (1, 128), (128, 128), (16, 16)])
def test_e4m3_blocks_take_the_kernels_power_of_two_scale(block):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((300, 200)) * np.exp(2 * rng.standard_normal((300, 1)))).astype(np.float32)
    x[7] = 0.0                                                      # an all-zero row: scale 1, stays zero
    q = fp8_gemm.e4m3(x, block)
    br, bc = block[0] or x.shape[0], block[1] or x.shape[1]
    for r in range(0, x.shape[0], br):
        for c in range(0, x.shape[1], bc):
            xb, qb = x[r:r + br, c:c + bc], q[r:r + br, c:c + bc]
            amax = float(np.abs(xb).max())
            s = 2.0 ** np.floor(np.log2(448.0 / amax)) if amax > 0 else 1.0
            assert amax == 0 or 224 < amax * s <= 448
            want = (xb * np.float32(s)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) / np.float32(s)
            np.testing.assert_array_equal(qb, want)
