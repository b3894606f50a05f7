"""The GEMM autotune's choice logic (Matmul.choose) on a fake event clock, and the route each candidate takes
(Matmul.gemm, gemm_with) with the kernels recorded: no GPU needed."""

import types

import numpy as np
import pytest

from clefcore.backends.cuda.matmul import Matmul
from clefcore.backends.cuda.state import GemmChoices
from clefcore.kernel_select import Device, GemmRoute, Setting
from clefcore.precision import Plan

C, W, R = GemmRoute.CUBLAS, GemmRoute.WMMA, GemmRoute.ROWS


class _Clock:
    def __init__(self):
        self.t = 0.0
        clock = self

        class Event:
            def record(self):
                self.t = clock.t

            def synchronize(self):
                pass
        self.cuda = types.SimpleNamespace(Event=Event, get_elapsed_time=lambda a, b: b.t - a.t)


def _ops(pin=None):
    """A Matmul's state: its choices, and a device context of the split plan on a fake clock."""
    return types.SimpleNamespace(choices=GemmChoices(pin), ctx=types.SimpleNamespace(plan=Plan("split"), cp=_Clock()))


def _route(ops, calls, name, cost, hiccup_on=None):
    def run():
        calls[name] = calls.get(name, 0) + 1
        ops.ctx.cp.t += cost + (10.0 if calls[name] == hiccup_on else 0.0)
    return run


def test_a_hiccup_on_one_timed_run_does_not_pick_the_slower_route():
    ops, calls = _ops(), {}
    routes = {C: _route(ops, calls, C, 1.0, hiccup_on=2), W: _route(ops, calls, W, 2.0)}
    assert Matmul.choose(ops, 300, 64, 64, routes, "t") is C
    assert calls == {C: 6, W: 6}                  # one warm-up run + 5 timed runs each
    assert ops.choices.chosen == {(64, 64, 512, "t", "split"): C}


def test_the_choice_is_kept_per_shape_bucket_and_a_forced_mode_wins():
    ops, calls = _ops(), {}
    routes = {C: _route(ops, calls, C, 3.0), W: _route(ops, calls, W, 2.0)}
    assert Matmul.choose(ops, 300, 64, 64, routes, "t") is W
    n = dict(calls)
    assert Matmul.choose(ops, 512, 64, 64, routes, "t") is W and calls == n     # same bucket: not re-timed
    assert Matmul.choose(ops, 513, 64, 64, routes, "t") is W and calls != n     # next bucket: timed
    assert Matmul.choose(_ops(C), 300, 64, 64, routes, "t") is C


def test_gemm_routes_records_each_choice_inside_its_block_only():
    """Matmul.gemm_routes: every choose inside the block is recorded under the autotune's key, a pinned mode's
    too; nothing is recorded before or after it."""
    ops, calls = _ops(), {}
    routes = {C: _route(ops, calls, C, 1.0), W: _route(ops, calls, W, 2.0)}
    Matmul.choose(ops, 300, 64, 64, routes, "before")
    with Matmul.gemm_routes(ops) as seen:
        Matmul.choose(ops, 300, 64, 64, routes, "t")
        ops.choices.pin = W
        Matmul.choose(ops, 20, 128, 64, routes, "t")
    ops.choices.pin = None
    Matmul.choose(ops, 300, 64, 64, routes, "after")
    assert seen == {(64, 64, 512, "t", "split"): C, (128, 64, 32, "t", "split"): W}
    assert ops.choices.seen is None


class _Routes:
    """Matmul's GEMM plumbing with every kernel call recorded instead of launched (no GPU): what gemm and
    gemm_with run for a plan and an operand dtype."""

    gemm, gemm_with = Matmul.gemm, Matmul.gemm_with

    def __init__(self, path, twinned=False, pick=C, mma=False):
        self.plan, self.twinned, self.pick, self.calls = Plan(path), twinned, pick, []
        # a device context of an sm_80 GPU where the mma route runs, else a Turing one
        self.ctx = types.SimpleNamespace(
            cp=types.SimpleNamespace(float32=np.float32, float16=np.float16), half=self._half,
            setting=Setting(self.plan.row, frozenset(), Device((8, 0) if mma else (7, 5), True, 166912, True)))

    def choose(self, M, N, K, routes, tag):
        want = {W, C} | ({R} if tag == "float32" and M <= 64 else set())
        want |= {GemmRoute.MMA} if self.ctx.setting.device.cc >= (8, 0) and self.plan.row.gemm.fp16 and K % 8 == 0 \
            else set()
        assert set(routes) == want
        return self.pick

    def has_twin(self, M, *ws):
        return self.plan.row.gemm.fp8_lo and self.twinned

    def _step(name, passes=False):          # a conversion (passes its operand on) or a GEMM, recorded
        return lambda self, x, *args, **kw: self.calls.append(name) or (x if passes else None)

    def _kernel(name):                      # one of clefcore's GEMMs: it adds the bias itself
        return lambda self, a, w, out, bias=None: self.calls.append((name, bias is not None))

    _half, split, split8 = _step("half", True), _step("split", True), _step("split8", True)
    cublas, split_gemm, split8_gemm = _step("cublas"), _step("split_gemm"), _step("split8_gemm")
    mma, wmma, gemm_rows = _kernel("mma"), _kernel("wmma"), _kernel("rows")


@pytest.mark.parametrize("path, twinned, dtype, want", [
    ("fp16", False, np.float32, ["half", "cublas"]),
    ("split", False, np.float32, ["split", "split_gemm"]),
    ("split8", True, np.float32, ["split8", "split8_gemm"]),
    ("split8", False, np.float32, ["split", "split_gemm"]),       # a weight without its fp8 twin runs split
    ("split", False, np.float16, ["half", "cublas"]),             # an fp16 operand goes to cuBLAS as it is
])
def test_the_cublas_candidate_follows_the_plan(path, twinned, dtype, want):
    ops = _Routes(path, twinned)
    x, w, out, bias = np.ones((100, 32), dtype), np.ones((16, 32)), np.zeros((100, 16), np.float32), np.ones(16)
    assert ops.gemm(x, w, out, bias) is out
    assert ops.calls == want
    np.testing.assert_array_equal(out, 1.0)                       # the bias added once, after the product


@pytest.mark.parametrize("pick", [W, R])
def test_own_kernels_take_the_bias_themselves(pick):
    ops = _Routes("split", pick=pick)
    out = np.zeros((8, 16), np.float32)
    ops.gemm(np.ones((8, 32), np.float32), np.ones((16, 32)), out, np.ones(16))
    assert ops.calls == [(pick.value, True)] and not out.any()


@pytest.mark.parametrize("path, K, offered", [("fp16", 32, True), ("fp16", 36, False), ("split", 32, False)])
def test_gemm_mma_is_a_candidate_of_the_fast_plan_where_it_runs(path, K, offered):
    """gemm_mma.cu (sm_80+, native code: GemmChoices.mma) is timed against the others for fp16 operands with
    K % 8 == 0 (its 16-byte copies), converts an fp32 operand once, and adds the bias in its epilogue."""
    ops = _Routes(path, pick=GemmRoute.MMA if offered else W, mma=True)
    out = np.zeros((100, 16), np.float32)
    ops.gemm(np.ones((100, K), np.float32), np.ones((16, K)), out, np.ones(16))
    assert ops.calls == (["half", ("mma", True)] if offered else [("wmma", True)]) and not out.any()


def test_an_unknown_route_is_refused():
    """A route's name is not a route: only GemmRoute members run."""
    with pytest.raises(ValueError, match="gemm route 'wmma'"):
        _Routes("split").gemm_with("wmma", np.ones((1, 1)), np.ones((1, 1)), np.zeros((1, 1)))
