"""Both backends implement ``clefcore.backends.interface.Backend`` (checked without a GPU: a CpuOps, and
CudaOps's class), and the engine, the model and the vision tower ask a backend for nothing else: run end to
end on a backend that answers only the interface's members, they ask for no other name (a private helper, a
probe for an optional attribute) and answer as the plain numpy backend does."""

from __future__ import annotations

import inspect

import pytest

import clefcore
from clefcore import engine as engine_module
from clefcore.backends import cpu
from clefcore.backends.cpu import CpuOps
from clefcore.backends.cuda.ops import CudaOps
from clefcore.backends.interface import Backend
from clefcore.precision import FP32, Plan

from golden_images_data import MODEL, REQUESTS
from golden_requests import BODIES

METHODS = {n: f for n, f in vars(Backend).items() if inspect.isfunction(f) and not n.startswith("_")}
DATA = [n for n in Backend.__annotations__]
TEXT = BODIES[0]


def _params(fn, drop_self: bool) -> list[str]:
    names = list(inspect.signature(fn).parameters)
    return names[1:] if drop_self else names


def _class_members(cls) -> set[str]:
    """What a class declares: attributes, methods and properties, and the annotated instance attributes."""
    out = set()
    for c in cls.__mro__:
        out |= set(vars(c)) | set(vars(c).get("__annotations__", {}))
    return out


class InterfaceOnly:
    """A CpuOps behind the interface: a member of ``Backend`` is the CpuOps's; any other name is recorded in
    ``outside`` and missing (an AttributeError, as from a backend without it), so a getattr/hasattr probe with
    a default is caught too."""

    def __init__(self, ops: CpuOps):
        object.__setattr__(self, "_ops", ops)
        object.__setattr__(self, "outside", [])

    def __getattr__(self, name):
        if name in METHODS or name in DATA:
            return getattr(self._ops, name)
        self.outside.append(name)
        raise AttributeError(name)

    def __setattr__(self, name, value):
        if name not in DATA:
            self.outside.append(name)
        setattr(self._ops, name, value)


def _answers(engine) -> list:
    """Text and image requests, decided whole and packed, and the image request's chunked prefill."""
    out = [engine.decide(TEXT), engine.decide(REQUESTS[0]), engine.decide_many([TEXT, REQUESTS[0]])]
    run = engine.chunked(engine.prepare(REQUESTS[0]), 37)
    while not run.step():
        pass
    out.append([z.tolist() for z in run.logits()])
    out.append(engine.status().memory_in_use)
    return out


def test_the_engine_asks_a_backend_only_for_the_interface(monkeypatch):
    plain = clefcore.load(MODEL, device="cpu", validation="reference")
    strict = InterfaceOnly(CpuOps())
    monkeypatch.setattr(engine_module, "backend_for", lambda device, options: strict)
    wrapped = clefcore.load(MODEL, device="cpu", validation="reference")
    assert wrapped.ops is strict and wrapped.vision is not None
    got = _answers(wrapped)
    assert strict.outside == []
    assert got == _answers(plain)


def test_a_name_outside_the_interface_is_caught():
    """The check above can fail: a private helper, a probe with a default and a new attribute are recorded."""
    strict = InterfaceOnly(CpuOps())
    assert getattr(strict, "cublas_missing", None) is None and not hasattr(strict, "_twins")
    with pytest.raises(AttributeError):
        strict._split
    strict.plan = Plan(FP32)
    strict.fallback_count = 1
    assert strict.outside == ["cublas_missing", "_twins", "_split", "fallback_count"]


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
