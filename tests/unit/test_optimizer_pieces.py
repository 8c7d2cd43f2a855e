"""A plain optimizer state dict assembled from pieces, in both ZeRO-1/2 formats."""

from __future__ import annotations

import pytest
import torch

from phalanx.sharding.optimizer_pieces import full_optimizer_state
from phalanx.sharding.pieces import Piece, PieceReader

GROUPS = [{"lr": 0.1, "params": [0, 1]}]


def _reader(tensors: dict[str, tuple[tuple[int, ...], list[torch.Tensor]]]) -> PieceReader:
    """Each key split into consecutive pieces (as several ranks would write it)."""
    index, data = [], {}
    for key, (shape, parts) in tensors.items():
        start = 0
        for i, part in enumerate(parts):
            name = f"{key}#{i}"
            end = start + part.numel()
            index.append((Piece(key, shape, start, end), str(part.dtype)[6:], "f", name))
            data[name] = part
            start = end
    return PieceReader(index, lambda source: data)


def test_format_2_pieces_give_the_torch_optim_state() -> None:
    reader = _reader(
        {
            "param0/exp_avg": ((2, 2), [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])]),
            "param0/step": ((), [torch.tensor([5.0])]),
            "param0/count:py": ((), [torch.tensor([7])]),
            "param0/extra:none": ((), [torch.zeros(1, dtype=torch.bool)]),
            "param1/exp_avg": ((3,), [torch.tensor([6.0]), torch.tensor([7.0, 8.0])]),
        }
    )
    meta = {"format": "phalanx.zero/2", "num_params": 2, "param_groups": GROUPS}
    sd = full_optimizer_state(meta, reader)
    assert sd["param_groups"] == GROUPS
    first = sd["state"][0]
    assert torch.equal(first["exp_avg"], torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert (first["step"].shape, first["step"].item()) == ((), 5.0)
    assert (first["count"], first["extra"]) == (7, None)
    assert torch.equal(sd["state"][1]["exp_avg"], torch.tensor([6.0, 7.0, 8.0]))


def test_format_1_keeps_scalars_in_meta_and_is_still_read() -> None:
    reader = _reader(
        {
            "param0/exp_avg": ((2,), [torch.tensor([1.0]), torch.tensor([2.0])]),
            "param1/exp_avg": ((1,), [torch.tensor([3.0])]),
        }
    )
    meta = {
        "format": "phalanx.zero/1",
        "num_params": 2,
        "param_groups": GROUPS,
        "per_element": ["exp_avg"],
        "scalars": {"step": {"value": 4.0, "dtype": "float32"}},
    }
    state = full_optimizer_state(meta, reader)["state"]
    assert [s["step"].item() for s in state.values()] == [4.0, 4.0]
    assert torch.equal(state[0]["exp_avg"], torch.tensor([1.0, 2.0]))


def test_named_pieces_follow_the_models_parameter_order() -> None:
    reader = _reader({"b/m": ((1,), [torch.tensor([1.0])]), "a/m": ((2,), [torch.ones(2)])})
    meta = {
        "num_params": 2,
        "param_groups": GROUPS,
        "param_keys": ["a", "b"],
        "per_element": ["m"],
        "scalars": {},
    }
    state = full_optimizer_state(meta, reader, names=["b", "a"])["state"]
    assert [s["m"].numel() for s in state.values()] == [1, 2]
    with pytest.raises(ValueError, match=r"covers parameters \['a', 'b'\], the model has \['c'\]"):
        full_optimizer_state(meta, reader, names=["c"])
    with pytest.raises(ValueError, match="not a ZeRO optimizer checkpoint"):
        full_optimizer_state({"format": "x"}, reader)
