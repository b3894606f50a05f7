"""The forward's guards: an all-zero or non-finite layer output fails the request naming the layer, on every
backend."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import clefcore
from clefcore.errors import DeviceError
from clefcore.example_request import support_ticket

from test_heads import devices

MODEL = Path(__file__).parent / "golden" / "model"


@pytest.fixture(scope="module", params=devices())
def engine(request):
    return clefcore.load(str(MODEL), device=request.param)


def _sabotage(engine, layer, name, value):
    L = engine.params.layers[layer]
    saved = L[name]
    L[name] = saved * value
    return lambda: L.__setitem__(name, saved)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # the inf weights, on purpose
@pytest.mark.parametrize("layer,name,value,message", [
    (2, "mlp.down_proj.weight", 0.0, "layer 2 MLP output, tokens 0-"),
    (1, "linear_attn.out_proj.weight", 0.0, "layer 1 (linear_attention) output"),
    (3, "self_attn.o_proj.weight", np.float32(np.inf), "layer 3 (full_attention) output"),
])
def test_a_broken_layer_fails_the_request_and_names_it(engine, layer, name, value, message):
    assert engine.checkpoint.text.layer_types[3] == "full_attention"
    good = engine.self_check()
    restore = _sabotage(engine, layer, name, value)
    try:
        with pytest.raises(DeviceError) as e:
            engine.decide(support_ticket())
        assert message in str(e.value)
        assert ("all" in str(e.value) and "zero" in str(e.value)) if value == 0 else "NaN or Inf" in str(e.value)
    finally:
        restore()
    assert engine.self_check() == good                     # nothing sticks to the next request
