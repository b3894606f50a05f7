"""Both backends implement ``clefcore.backends.interface.Backend`` (checked without a GPU: a CpuOps, and CudaOps's
class), and nothing outside the interface's module probes a backend with getattr/hasattr."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from clefcore.backends import cpu
from clefcore.backends.cpu import CpuOps
from clefcore.backends.cuda.ops import CudaOps
from clefcore.backends.interface import Backend
from clefcore.precision import FP32, Plan

ROOT = Path(__file__).resolve().parent.parent
METHODS = {n: f for n, f in vars(Backend).items() if inspect.isfunction(f) and not n.startswith("_")}
DATA = [n for n in Backend.__annotations__]


def _params(fn, drop_self: bool) -> list[str]:
    names = list(inspect.signature(fn).parameters)
    return names[1:] if drop_self else names


def _class_members(cls) -> set[str]:
    """What a class declares: attributes, methods and properties, and the annotated instance attributes."""
    out = set()
    for c in cls.__mro__:
        out |= set(vars(c)) | set(vars(c).get("__annotations__", {}))
    return out


def test_the_interface_lists_what_the_model_calls():
    """Every ``ops.<name>`` in the model, the tower and the engine is a member of the interface."""
    called = set()
    for f in [*sorted((ROOT / "clefcore" / "model").glob("*.py")), ROOT / "clefcore/vision.py",
              ROOT / "clefcore/engine.py"]:
        called |= set(re.findall(r"\bops\.([a-z_0-9]+)", f.read_text()))
    assert called and called <= set(METHODS) | set(DATA), sorted(called - set(METHODS) - set(DATA))


def test_numpy_backend_implements_the_interface():
    ops = CpuOps()
    assert isinstance(ops, Backend)
    for name, fn in METHODS.items():
        assert _params(getattr(ops, name), False) == _params(fn, True), name


def test_numpy_backend_keeps_its_state_per_instance():
    """What a caller may set on a backend (plan, token block, graphs) belongs to one CpuOps; the module itself
    holds only functions and constants, none of the interface's attributes."""
    a, b = CpuOps(), CpuOps()
    a.plan, a.token_block, a.graphs = Plan("fp16"), 16, object()
    assert (b.plan, b.token_block, b.graphs) == (Plan(FP32), 0, None)
    assert [n for n in DATA if n in vars(cpu)] == []


def test_cuda_backend_implements_the_interface():
    members = _class_members(CudaOps)
    assert [n for n in DATA if n not in members] == []
    for name, fn in METHODS.items():
        assert name in members, name
        assert _params(getattr(CudaOps, name), True) == _params(fn, True), name


def test_a_missing_member_is_caught():
    """The checks above can fail: a backend without one interface member is not a Backend."""
    class Partial:
        pass

    ops = CpuOps()
    for n in DATA + list(METHODS):
        if n != "patch_rows":
            setattr(Partial, n, getattr(ops, n))
    assert not isinstance(Partial(), Backend)
    Partial.patch_rows = staticmethod(cpu.patch_rows)
    assert isinstance(Partial(), Backend)


PROBE = re.compile(r"\b(?:getattr|hasattr)\(\s*(?:[\w.]*\.)?ops\b")
PRIVATE = re.compile(r"\bops\._\w")          # a backend's private member, reached from outside the backend


def _lines_matching(tree, pattern, skip):
    found = []
    for path in sorted((ROOT / tree).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not skip(rel):
            found += [f"{rel}:{i}" for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    return found


@pytest.mark.parametrize("tree", ["clefcore", "server"])
def test_no_backend_is_probed_outside_the_interface(tree):
    assert _lines_matching(tree, PROBE, lambda rel: rel == "clefcore/backends/interface.py") == []


@pytest.mark.parametrize("tree", ["clefcore", "server"])
def test_nothing_outside_the_backends_reaches_their_private_members(tree):
    """bench included: it measures through public methods (gemm_with, plan, twins, gemm)."""
    assert _lines_matching(tree, PRIVATE, lambda rel: rel.startswith("clefcore/backends/")) == []


def test_the_probe_pattern_matches_the_old_probes():
    for line in ('getattr(self.ops, "mode", "fp32")', 'hasattr(ops, "cublas_missing")',
                 'getattr(engine.ops, "fallback", None)', "getattr( ops, 'graphs')"):
        assert PROBE.search(line), line
    assert not PROBE.search('getattr(args, "reuse_port", False)')


def test_the_private_pattern_matches_the_old_calls():
    for line in ("lambda: ops._split_gemm(ops._split(x), w, o)", "ops._twins.pop(w.data.ptr, None)",
                 "self.ops._wmma(x, w, o)"):
        assert PRIVATE.search(line), line
    for line in ("ops.gemm_with(route, x, w, o)", "ops.twins.drop(w)", "gpu_ops._x"):
        assert not PRIVATE.search(line), line


def test_bench_uses_only_what_cuda_ops_has():
    """bench runs only on a GPU, so its calls are checked here too: every ``ops.<name>`` in clefcore/bench/ is a
    member of CudaOps (of the class, or set by its __init__)."""
    used = set()
    for path in (ROOT / "clefcore" / "bench").glob("*.py"):
        used |= set(re.findall(r"\bops\.([a-z_0-9]+)", path.read_text()))
    members = _class_members(CudaOps) | set(re.findall(r"\bself\.(\w+)\s*=", inspect.getsource(CudaOps.__init__)))
    assert {"gemm_with", "plan", "twins", "gemm"} <= used and used <= members, sorted(used - members)
