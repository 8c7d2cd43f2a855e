"""The state codec of live recovery's transfer: every type and every bit survives."""

from __future__ import annotations

import json
import math
import random
from typing import Any

import pytest
import torch

from phalanx.recovery import rng_state, set_rng_state
from phalanx.recovery.transfer import _decode, _encode, _layout, _pack, _unpack


def _round_trip(state: dict[str, Any]) -> dict[str, Any]:
    tensors: list[torch.Tensor] = []
    tree = _encode(state, tensors, "state")
    metas, size = _layout(tensors)
    buffer = _pack(tensors, metas, size, torch.device("cpu"))
    wire = json.loads(json.dumps({"tree": tree, "tensors": metas}))
    out = _decode(wire["tree"], _unpack(buffer.clone(), wire["tensors"]))
    assert isinstance(out, dict)
    return out


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_tensors_arrive_bit_identical_in_every_dtype_and_shape() -> None:
    nan = torch.tensor([float("nan"), -0.0, float("inf")])
    state = {
        "nan": nan,
        "bf16": torch.randn(7).to(torch.bfloat16),
        "f64": torch.randn(2, 3, dtype=torch.float64),
        "bool": torch.tensor([True, False, True]),
        "i8": torch.tensor([-3, 5], dtype=torch.int8),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "strided": torch.arange(12.0).reshape(3, 4).t(),
        "complex": torch.randn(3, dtype=torch.complex64),
    }
    out = _round_trip(state)
    for key, t in state.items():
        assert out[key].dtype == t.dtype and out[key].shape == t.shape, key
        assert _bits(out[key]) == _bits(t), key


def test_structure_and_key_types_survive() -> None:
    opt = torch.optim.Adam([torch.nn.Parameter(torch.ones(2))])
    opt.param_groups[0]["params"][0].grad = torch.ones(2)
    opt.step()
    state = {"optim": opt.state_dict(), "t": (1, (2.5, None)), "flags": [True, 1, "x", math.inf]}
    out = _round_trip(state)
    assert list(out["optim"]["state"]) == [0]  # an int key, as load_state_dict needs
    assert out["t"] == (1, (2.5, None)) and isinstance(out["t"][1], tuple)
    assert out["flags"] == [True, 1, "x", math.inf] and out["flags"][0] is True
    torch.optim.Adam([torch.nn.Parameter(torch.ones(2))]).load_state_dict(out["optim"])


def test_unsupported_values_are_refused_with_their_path() -> None:
    with pytest.raises(TypeError, match=r"state\['a'\]\[1\] is a set"):
        _round_trip({"a": [1, {2}]})
    with pytest.raises(TypeError, match="key of type"):
        _round_trip({"a": {(1, 2): 3}})
    with pytest.raises(TypeError, match="only dense"):
        _round_trip({"s": torch.eye(2).to_sparse()})


def test_rng_state_round_trips_through_the_codec() -> None:
    random.seed(1)
    torch.manual_seed(1)
    saved = _round_trip({"rng": rng_state()})["rng"]
    expected = (random.random(), torch.rand(3))
    random.seed(2)
    torch.manual_seed(2)
    set_rng_state(saved)
    assert random.random() == expected[0]
    assert torch.equal(torch.rand(3), expected[1])
