"""The WY-form delta rule on the CPU (kernels: tests/test_gdn_wy_gpu.py): its numpy model
(tests/gdn_wy_model.py) against cpu.gated_delta_rule, and backends/cuda/delta_rule.py's host code driving
numpy twins of the kernels."""

from __future__ import annotations

import types

import numpy as np
import pytest

from clefcore import kernel_select, precision, switches
from clefcore.backends import cpu
from clefcore.backends.cuda.compile import kernel_dir
from clefcore.backends.cuda.delta_rule import DeltaRule
from clefcore.precision import Plan

import gdn_wy_model as wy

C = wy.C
SM70_SMEM = 98304   # the most dynamic shared memory a block may opt in to on sm_70 (the lowest target)


def inputs(cu, hk, hv, dk, dv, seed, decay=None):
    return wy.draw(np.random.default_rng(seed), cu, hk, hv, dk, dv, decay)


rel, floor_of = wy.rel, wy.floor_of


CU = [[0, 1], [0, 63], [0, 64], [0, 65], [0, 130], [0, 1, 64, 129, 259], [0, 65, 130, 131], [0, 17, 17, 147]]
SHAPES = [(2, 4, 16, 16), (1, 2, 128, 128), (2, 2, 32, 64)]
# fp32 products in another order (the solve by substitution, the decay folded into V' and exp(G) applied after Q S):
# measured 4e-7 of the output / state, here at 2e-5 as tests/test_gdn_state.py holds the reference to float64
FP32_TOL = 2e-5


# ------------------------------------------------------------------------------------------------ the model
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "carried-state"])
@pytest.mark.parametrize("cu", CU)
@pytest.mark.parametrize("hk,hv,dk,dv", SHAPES)
def test_model_in_fp32_is_the_numpy_reference(cu, hk, hv, dk, dv, with_state):
    args, S0 = inputs(cu, hk, hv, dk, dv, seed=len(cu) * 1000 + cu[-1] + dk)
    cu = np.array(cu)
    S_ref, S = (S0.copy(), S0.copy()) if with_state else (None, None)
    ref = cpu.gated_delta_rule(*args, cu, S_ref)
    got = wy.gated_delta_rule(*args, cu, S, operands=wy.FP32)
    assert rel(got, ref, floor_of(args[0], args[1], args[2], args[4])) <= FP32_TOL
    if with_state:
        assert rel(S, S_ref) <= FP32_TOL
        # the empty sequence of [0, 17, 17, 147] keeps its state
        for b in np.nonzero(np.diff(cu) == 0)[0]:
            np.testing.assert_array_equal(S[b], S0[b])


@pytest.mark.parametrize("split", [1, 63, 64, 65, 129])
def test_model_carries_its_state_across_calls(split):
    """A sequence cut anywhere, the state carried from the first call to the second, gives one call's result."""
    T = 200
    args, S0 = inputs([0, T], 2, 4, 16, 16, seed=split)
    S_whole, S_parts = S0.copy(), S0.copy()
    whole = wy.gated_delta_rule(*args, np.array([0, T]), S_whole, operands=wy.EXACT)
    first = wy.gated_delta_rule(*(a[:split] for a in args), np.array([0, split]), S_parts, operands=wy.EXACT)
    second = wy.gated_delta_rule(*(a[split:] for a in args), np.array([0, T - split]), S_parts, operands=wy.EXACT)
    assert rel(np.concatenate([first, second]), whole) <= FP32_TOL
    assert rel(S_parts, S_whole) <= FP32_TOL


def test_the_operand_roundings_are_the_ones_named():
    """fp16: each operand rounded once (a product error of order 2^-11); split: hi + lo with the lo * lo term left
    out (order 2^-22); fp32: fp32 products. Measured on normal-range operands against float64."""
    rng = np.random.default_rng(0)
    a = rng.uniform(0.5, 1.0, (64, 128)).astype(np.float32)
    b = rng.uniform(0.5, 1.0, (128, 32)).astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    err = {how: rel(wy.mm(a, b, how), exact) for how in wy.OPERANDS}
    assert 2 ** -14 < err["fp16"] < 2 ** -10
    assert err["split"] < 2 ** -20 and err["fp32"] < 2 ** -20
    hi, lo = wy.split(a)
    assert hi.dtype == lo.dtype == np.float16
    assert rel(hi.astype(np.float64) + lo, a) < 2 ** -21
    with pytest.raises(ValueError, match="Operands.qs"):
        wy.Operands("split", "split", "split", "bf16", "split", "split")


# ---------------------------------------------------------------------------- the host code, on numpy twins
class Arr(np.ndarray):
    """A numpy array with CuPy's ``.data.ptr`` (the host code checks alignments)."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])


def _arr(x, dtype=None):
    return np.asarray(x, dtype).view(Arr)


NUMPY_CP = types.SimpleNamespace(float32=np.float32, float16=np.float16,
                                 empty=lambda shape, dtype: np.full(shape, np.nan, dtype).view(Arr),
                                 ascontiguousarray=lambda x: np.ascontiguousarray(x).view(Arr))


def _halves(w, lo: bool):
    """A workspace operand [..., 2, rows, cols] of fp16 halves as fp32 values (hi + lo, or hi alone)."""
    x = w[..., 0, :, :].astype(np.float32)
    return x + w[..., 1, :, :].astype(np.float32) if lo else x


class TwinDevice:
    """The device context DeltaRule reads, over numpy: ``kernel`` hands out numpy twins of the WY kernels, which
    take the launches' own grids and arguments and read and write the workspaces in the kernels' layouts
    (cuda/gated_delta_wy.cu), with the module's operand roundings (gdn_wy_model.KERNEL_OPERANDS)."""

    cp = NUMPY_CP
    sm_count = 132

    def __init__(self, path: str, on: frozenset = frozenset()):
        self.plan = Plan(path)
        self.on = on              # the kernel switches in effect
        self.launched = []        # (module, kernel name, shared memory bytes)

    @property
    def setting(self) -> kernel_select.Setting:
        """What the delta rule's choice reads (kernel_select.delta_rule): the plan's row and switches, on an H100."""
        return kernel_select.Setting(self.plan.row, self.on, kernel_select.Device((9, 0), True, 232_448, True))

    to_host, upload = staticmethod(np.asarray), staticmethod(_arr)

    def contiguous(self, x):
        return np.ascontiguousarray(x, np.float32).view(Arr)

    def f32(self, x):
        return _arr(x, np.float32)

    def kernel(self, module, name, smem=0):
        self.launched.append((module, name, smem))
        ops = wy.KERNEL_OPERANDS[module]
        twin = {"prep": self._prep, "scan": self._scan, "out": self._out}[name[len("gdn_wy_"):].removesuffix("_d128")]

        def launch(grid, block, args, shared_mem=0):
            assert block == (256,) and shared_mem == smem
            twin(grid, ops, *args)
        return launch

    @staticmethod
    def _prep(grid, ops, k, v, vs, g, beta, chunks, hk, hv, dk, dv, Gw, Uw, Ww, Kw):
        assert grid == (len(chunks), hv) and v.strides[0] == 4 * vs
        rep = hv // hk
        for c, (t0, n, _, _) in enumerate(chunks):
            def rows(a):   # the chunk's rows, zero-padded to C
                return np.concatenate([a[t0:t0 + n], np.zeros((C - n,) + a.shape[1:], np.float32)])
            K = rows(k).transpose(1, 0, 2)                                     # [hk, C, dk]
            gam, U, W = wy.prep(np.repeat(K, rep, axis=0), rows(v).transpose(1, 0, 2), rows(g).T, rows(beta).T,
                                ops)
            Gw[c], Uw[c] = gam, U
            Ww[c, :, 0], Ww[c, :, 1] = wy.split(-W)
            Kw[c, :, 0], Kw[c, :, 1] = wy.split(K)

    @staticmethod
    def _scan(grid, ops, seqs, hk, hv, dk, dv, bv, Gw, Uw, Ww, Kw, state, Hw):
        assert grid == (hv, dv // bv, len(seqs)) and bv in (16, 32) and dv % bv == 0
        split = ops.ws == "split"
        for first, end, zero, slot in seqs:
            S = np.zeros((hv, dk, dv), np.float32) if zero else state[slot].copy()
            for c in range(first, end):
                Hw[c, :, 0], Hw[c, :, 1] = wy.split(S)
                K = np.repeat(_halves(Kw[c], split), hv // hk, axis=0)
                Uw[c], S = wy.scan_step(S, Gw[c], Uw[c], -_halves(Ww[c], split), K, ops)
            state[slot] = S

    @staticmethod
    def _out(grid, ops, q, chunks, hk, hv, dk, dv, Gw, Uw, Kw, Hw, out):
        assert grid == (len(chunks), hv)
        rep = hv // hk
        for c, (t0, n, _, _) in enumerate(chunks):
            Q = np.concatenate([q[t0:t0 + n], np.zeros((C - n, hk, dk), np.float32)]).transpose(1, 0, 2)
            K = _halves(Kw[c], ops.qk == "split")
            O = wy.out(np.repeat(Q, rep, axis=0), np.repeat(K, rep, axis=0), Gw[c], _halves(Hw[c], ops.qs == "split"),
                       Uw[c], ops)
            out[t0:t0 + n] = O.transpose(1, 0, 2)[:n]


def twin_rule(path: str, on: frozenset = frozenset()) -> DeltaRule:
    """The backend's DeltaRule on a TwinDevice of the plan ``path`` and switches ``on``, in launch groups of 128
    chunks."""
    return DeltaRule(TwinDevice(path, on), 128)


# each mode's kernels, and fast's under the wy_one_pass switch: (plan path, switches on)
MODES = {"fast": ("fp16", frozenset()), "fast-one-pass": ("fp16", frozenset({switches.WY_ONE_PASS})),
         "exact": ("split", frozenset())}


@pytest.mark.parametrize("blk", [128, 2, 1], ids=["one-group", "groups-of-2", "groups-of-1"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "carried-state"])
@pytest.mark.parametrize("cu", [[0, 1], [0, 65], [0, 130], [0, 1, 64, 129, 259], [0, 17, 17, 147]])
@pytest.mark.parametrize("mode", list(MODES))
def test_host_code_on_numpy_twins_lands_on_the_reference(mode, cu, with_state, blk):
    """Launch groups cutting sequences (the state carried through the state buffer between groups), packed and
    empty sequences, states given or not: the host code's launches reproduce the numpy reference within what the
    mode's roundings explain (the error model on the same inputs, +25 % for the twins' own fp32 order)."""
    hk, hv, dk, dv = 2, 4, 16, 32
    args, S0 = inputs(cu, hk, hv, dk, dv, seed=cu[-1] * 7 + len(cu) + blk)
    cu = np.array(cu)
    S_ref, S_model = S0.copy(), S0.copy()
    ref = cpu.gated_delta_rule(*args, cu, S_ref if with_state else None)
    ops = twin_rule(*MODES[mode])
    ops.block_chunks = blk
    S = _arr(S0.copy()) if with_state else None
    got = ops.gated_delta_rule(*(_arr(a) for a in args), cu, S)
    operands = wy.KERNEL_OPERANDS[ops.kernels().module]
    model = wy.gated_delta_rule(*args, cu, S_model if with_state else None, operands=operands)
    fl = floor_of(args[0], args[1], args[2], args[4])
    assert rel(got, ref, fl) <= 1.25 * rel(model, ref, fl) + FP32_TOL
    if with_state:
        assert rel(S, S_ref) <= 1.25 * rel(S_model, S_ref) + FP32_TOL
        for b in np.nonzero(np.diff(cu) == 0)[0]:
            np.testing.assert_array_equal(S[b], S0[b])
    names = [n for _, n, _ in ops.ctx.launched]
    assert names[:3] == ["gdn_wy_prep", "gdn_wy_scan", "gdn_wy_out"]


def test_host_code_takes_a_strided_value_view():
    """v as the engine passes it: a column slice of the conv output (a token stride wider than hv * dv)."""
    hk, hv, dk, dv, T = 1, 2, 16, 16, 130
    args, _ = inputs([0, T], hk, hv, dk, dv, seed=3)
    wide = np.concatenate([np.zeros((T, 3 * hv * dv), np.float32), args[2].reshape(T, hv * dv)], axis=1)
    v = _arr(wide)[:, 3 * hv * dv:].reshape(T, hv, dv)
    assert v.strides[0] == 4 * 4 * hv * dv
    ops = twin_rule("split")
    got = ops.gated_delta_rule(_arr(args[0]), _arr(args[1]), v, _arr(args[3]), _arr(args[4]), np.array([0, T]))
    ref = cpu.gated_delta_rule(*args, np.array([0, T]))
    assert rel(got, ref) <= FP32_TOL * 5


@pytest.mark.parametrize("hk,hv,dk,dv", SHAPES + [(16, 32, 128, 128), (1, 1, 128, 16), (1, 1, 16, 128)])
@pytest.mark.parametrize("mode", list(MODES))
def test_shared_memory_fits_volta(mode, hk, hv, dk, dv):
    """Every WY launch asks for at most the 96 KB a block may have on sm_70; the model's 128 x 128 heads take the
    _d128 entries."""
    args, _ = inputs([0, 130], hk, hv, dk, dv, seed=1)
    ops = twin_rule(*MODES[mode])
    ops.gated_delta_rule(*(_arr(a) for a in args), np.array([0, 130]))
    assert {n for _, n, _ in ops.ctx.launched} == {f"gdn_wy_{k}{'_d128' if dk == dv == 128 else ''}"
                                                   for k in ("prep", "scan", "out")}
    assert max(s for _, _, s in ops.ctx.launched) <= SM70_SMEM


# ------------------------------------------------------------------------------------------------- routing
@pytest.mark.parametrize("one_pass", [False, True], ids=["switches-off", "wy_one_pass"])
@pytest.mark.parametrize("path", precision.KERNEL_PATHS)
def test_each_path_runs_its_modes_wy_module(path, one_pass):
    """Every GPU path runs the WY kernels of its mode: fast's module (its one-pass module under wy_one_pass), or
    exact's (whatever the switch)."""
    args, _ = inputs([0, 65], 2, 4, 16, 16, seed=0)
    ops = twin_rule(path, frozenset({switches.WY_ONE_PASS}) if one_pass else frozenset())
    ops.gated_delta_rule(*(_arr(a) for a in args), np.array([0, 65]))
    fast = precision.DELTA_ONE_PASS if one_pass else precision.DELTA_FAST
    want = fast if precision.TABLE[path].mode == "fast" else precision.DELTA_EXACT
    assert ops.kernels() == want
    assert [(m, n) for m, n, _ in ops.ctx.launched] == [(want.module, f"gdn_wy_{k}") for k in ("prep", "scan", "out")]


def test_every_wy_module_has_an_error_model():
    """The GPU tests hold each WY module to the model of its operands: every module the selector can name, under
    any switches, has one."""
    device = kernel_select.Device((9, 0), True, 232_448, True)
    modules = {kernel_select.delta_rule(kernel_select.Setting(row, frozenset(on), device)).module
               for row in precision.TABLE.values() for on in ((), switches.SWITCHES)} - {None}
    assert modules == set(wy.KERNEL_OPERANDS)
    assert all((kernel_dir() / m).is_file() for m in modules)
