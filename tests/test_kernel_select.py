"""clefcore/kernel_select.py against a table of the kernel choices, for every kernel path the backend runs x every
switch state x every capability x the shape facts each family reads. No GPU, no CuPy. The table was written from
the CUDA backend's code as it chose before the choices moved into the selector (and compared case by case with
that code run on stand-ins), so it holds the selector to the choices the GPU suite validated:
- GEMM, the "mma" route: on cc >= 8.0 running native code (not the compute_70 PTX); gemm_wgmma.cu's tile on cc
  9.0 with the shared memory it needs, else the first of MMA_TILES whose shared memory fits.
- GEMM candidates: wmma and cublas always, rows for up to 64 rows of an fp32 x, mma where it runs (K % 8 == 0 and
  the row rounds once: ``row.gemm.fp16``) and the operand is not split; the MLP: wmma, cublas and mma where it
  runs on the hidden size and the row does not split; cublas dropped where cuBLAS cannot be loaded.
- The cublas candidate's route: split8 where the operand is split and the weight has an fp8 twin covering the
  shape, split where split, else cublas.
- Attention: attention_wgmma.cu on cc 9.0, native, D = 256, fp16 K/V; the bidirectional (vision) attention: the
  fp16 kernel where ``row.attention_fp16``, else fp32 products.
- Delta rule: ``row.delta_rule``; fast's one-pass module under wy_one_pass.
- Norms and gates: an fp16 GEMM operand where ``row.fused_elementwise`` and rows > 64.
- Head: the reduction kernel for batched products where cuBLAS cannot be loaded, else cuBLAS.
The per-row facts (ROWS) are the precision table's rows, written out here.
"""

from __future__ import annotations

import itertools

import pytest

from clefcore import gpu_settings, kernel_select, precision, switches
from clefcore.kernel_select import (ATTN, ATTN_WGMMA, MMA_TILES, WGMMA_TILE, Device, GemmRoute, Operand, Products,
                                    Setting)

C, S, S8, W, R, M_ = (GemmRoute.CUBLAS, GemmRoute.SPLIT, GemmRoute.SPLIT8, GemmRoute.WMMA, GemmRoute.ROWS,
                      GemmRoute.MMA)
BIG, SMALL = ("gemm_mma.cu", MMA_TILES[0]), ("gemm_mma.cu", MMA_TILES[1])
HOPPER = ("gemm_wgmma.cu", WGMMA_TILE)

# each GPU generation's opt-in shared memory per block (what CUDA reports), and the "mma" route's kernel there
# running native code; the compute_70 PTX has none
SMEM = {(7, 0): 98304, (7, 5): 65536, (8, 0): 166912, (8, 6): 101376, (8, 9): 101376, (9, 0): 232448}
MMA = {(7, 0): None, (7, 5): None, (8, 0): BIG, (8, 6): SMALL, (8, 9): SMALL, (9, 0): HOPPER}
# an H100 told it has less shared memory (as the GPU tests force each tile): the tile that fits then
LOWERED = {(9, 0, MMA_TILES[0][3]): BIG, (9, 0, MMA_TILES[1][3]): SMALL}

# the kernel paths the CUDA backend runs: (split operands, rounded once, fp8 lo, fp16 tower attention, delta rule
# file, fused producers)
ROWS = {"fp16": (False, True, False, True, "gated_delta_wy_fast.cu", True),
        "split": (True, False, False, False, "gated_delta_wy.cu", False),
        "split8": (True, False, True, False, "gated_delta_wy.cu", False)}


def _devices():
    for cc, native, cublas in itertools.product(SMEM, (True, False), (True, False)):
        yield Device(cc, native, SMEM[cc], cublas), MMA[cc] if native else None
    for (a, b, smem), tile in LOWERED.items():
        for cublas in (True, False):
            yield Device((a, b), True, smem, cublas), tile


def _switch_states():
    on = switches.SWITCHES
    return [frozenset(c) for n in range(len(on) + 1) for c in itertools.combinations(on, n)]


CASES = [(path, on, dev, tile) for path in ROWS for on in _switch_states() for dev, tile in _devices()]
GEMM_M, GEMM_K, ATTN_D, OPERAND_ROWS = (1, 64, 65, 4096), (20, 36, 4096), (16, 32, 64, 128, 256), (1, 64, 65, 4096)


def test_the_table_spans_every_path_switch_state_and_capability():
    assert set(ROWS) == set(precision.KERNEL_PATHS)
    assert len(_switch_states()) == 2 ** len(switches.SWITCHES)
    ccs = {dev.cc for _, _, dev, _ in CASES}
    assert ccs == {(7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0)}
    assert {(dev.cc, dev.native, dev.cublas) for _, _, dev, _ in CASES} == set(itertools.product(ccs, (True, False),
                                                                                                 (True, False)))


@pytest.mark.parametrize("path, on, dev, tile", CASES)
def test_every_choice_is_the_tabled_one(path, on, dev, tile):
    split, fp16, fp8, attn16, delta_file, fused = ROWS[path]
    s = Setting(precision.TABLE[path], on, dev)
    cublas = [C] if dev.cublas else []
    n = 0
    assert kernel_select.mma_tile(dev) == tile
    for M, K, x16 in itertools.product(GEMM_M, GEMM_K, (False, True)):
        mma = tile is not None and K % 8 == 0 and fp16 and not (split and not x16)
        want = [W] + cublas + ([R] if M <= 64 and not x16 else []) + ([M_] if mma else [])
        assert kernel_select.gemm_candidates(s, M, K, x16) == tuple(want), (M, K, x16)
        n += 1
    for K in GEMM_K:
        want = [W] + cublas + ([M_] if tile is not None and K % 8 == 0 and fp16 and not split else [])
        assert kernel_select.swiglu_candidates(s, K) == tuple(want), K
        n += 1
    for x16, twinned in itertools.product((False, True), (False, True)):
        want = (S8 if fp8 and twinned else S) if split and not x16 else C
        assert kernel_select.cublas_route(s, x16, lambda: twinned) is want, (x16, twinned)
        n += 1
    for D, kv16 in itertools.product(ATTN_D, (False, True)):
        want = ATTN_WGMMA if dev.cc == (9, 0) and dev.native and D == 256 and kv16 else ATTN
        assert kernel_select.causal_attention(s, D, kv16) is want, (D, kv16)
        n += 1
    assert kernel_select.bidirectional_attention(s) is (Products.FP16_KERNEL if attn16 else Products.FP32_CUBLAS)
    one_pass = fp16 and switches.WY_ONE_PASS in on
    assert kernel_select.delta_rule(s).module == ("gated_delta_wy_one_pass.cu" if one_pass else delta_file)
    for rows in OPERAND_ROWS:
        assert kernel_select.gemm_operand(s, rows) is (Operand.FP16 if fused and rows > 64 else Operand.FP32), rows
        n += 1
    assert kernel_select.head_products(s) is (Products.FP32_CUBLAS if dev.cublas else Products.FP32_REDUCTION)
    assert kernel_select.fp8_tensor_cores(dev) is (dev.cublas and dev.cc >= (8, 9))
    assert n + 5 == CASE_CHOICES


# choices checked per (path, switch state, device): 24 GEMM + 3 SwiGLU + 4 cuBLAS routes + 10 causal attention +
# 4 operand dtypes + mma tile, tower attention, delta rule, head, fp8
CASE_CHOICES = (len(GEMM_M) * len(GEMM_K) * 2 + len(GEMM_K) + 4 + len(ATTN_D) * 2 + len(OPERAND_ROWS) + 5)


def test_a_device_without_a_tile_that_fits_has_no_mma_route():
    """An sm_80+ device reporting less shared memory than the smaller tile's: no "mma" route (no such GPU exists;
    the backend used to offer the route and fail at its launch)."""
    assert kernel_select.mma_tile(Device((8, 6), True, MMA_TILES[1][3] - 1, True)) is None


def test_the_gemm_option_names_routes_of_the_one_vocabulary():
    assert gpu_settings.GEMM_CHOICES == ("auto", "wmma", "cublas")
    assert gpu_settings.gemm_pin("auto") is None
    assert [gpu_settings.gemm_pin(t) for t in gpu_settings.GEMM_CHOICES[1:]] == list(kernel_select.GEMM_PINS)
    with pytest.raises(ValueError, match="gemm must be one of auto, wmma, cublas, got 'split'"):
        gpu_settings.gemm_pin("split")
    # a pinned route is always a candidate, so a pin always runs
    for path, on, dev, _ in CASES:
        s = Setting(precision.TABLE[path], on, dev)
        if dev.cublas:
            assert set(kernel_select.GEMM_PINS) <= set(kernel_select.gemm_candidates(s, 300, 64, False))
            assert set(kernel_select.GEMM_PINS) <= set(kernel_select.swiglu_candidates(s, 64))
