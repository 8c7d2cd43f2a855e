"""``phalanx.LocalSGD`` / ``phalanx.DiLoCo`` options: checked when built, presets by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phalanx
from phalanx.local_sgd import DiLoCoSync, LocalSGDSync, Replica
from phalanx.local_sgd.checkpoint import replica_piece
from phalanx.train.strategies import resolve, strategy_names


@pytest.mark.parametrize(
    ("cls", "kwargs", "error", "message"),
    [
        (phalanx.LocalSGD, {"sync_every": 0}, ValueError, "LocalSGD(sync_every=0): sync_every"),
        (phalanx.LocalSGD, {"sync_every": 2.0}, TypeError, "sync_every must be an int >= 1"),
        (phalanx.LocalSGD, {"sync_every": True}, TypeError, "got bool True"),
        (phalanx.LocalSGD, {"bucket_cap_mb": 0}, ValueError, "bucket_cap_mb must be a number > 0"),
        (phalanx.DiLoCo, {"sync_every": -1}, ValueError, "DiLoCo(sync_every=-1)"),
        (phalanx.DiLoCo, {"outer_lr": 0.0}, ValueError, "outer_lr must be a number > 0, got"),
        (phalanx.DiLoCo, {"outer_lr": float("nan")}, ValueError, "DiLoCo(outer_lr=nan)"),
        (phalanx.DiLoCo, {"outer_lr": "0.7"}, TypeError, "outer_lr must be a number > 0"),
        (phalanx.DiLoCo, {"outer_momentum": 1.0}, ValueError, "a number >= 0 and < 1, got"),
        (phalanx.DiLoCo, {"outer_momentum": -0.5}, ValueError, "DiLoCo(outer_momentum=-0.5)"),
        (phalanx.DiLoCo, {"nesterov": "yes"}, TypeError, "DiLoCo(nesterov='yes')"),
    ],
)
def test_bad_options_name_the_argument_and_value(
    cls: type, kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        cls(**kwargs)


def test_defaults_and_presets() -> None:
    assert phalanx.DiLoCo() == phalanx.DiLoCo(500, 0.7, 0.9, True)  # the paper's
    assert resolve("diloco") == phalanx.DiLoCo()
    assert resolve("localsgd") == phalanx.LocalSGD()
    assert {"diloco", "localsgd"} <= set(strategy_names())
    assert phalanx.LocalSGD(sync_every=3).sync_every == 3


def test_the_algorithms_check_their_own_arguments() -> None:
    replica = Replica.of(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"LocalSGDSync\(every=0\)"):
        LocalSGDSync(replica, None, 0)
    with pytest.raises(ValueError, match=r"DiLoCoSync\(outer_momentum=1\)"):
        DiLoCoSync(replica, None, 2, 0.7, 1)
    with pytest.raises(ValueError, match=r"DiLoCoSync\(outer_lr=-1\)"):
        DiLoCoSync(replica, None, 2, -1, 0.9)


def test_replica_lists_trained_parameters_and_float_buffers() -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    model[0].bias.requires_grad_(False)
    replica = Replica.of(model)
    assert [n for n, _ in replica.params] == ["0.weight", "1.weight", "1.bias"]
    # num_batches_tracked (an integer) is not averaged.
    assert [n for n, _ in replica.buffers] == ["1.running_mean", "1.running_var"]
    replica.param_tensors[0].fill_(2.0)  # views of the model's parameters
    assert torch.equal(model[0].weight.detach(), torch.full((3, 2), 2.0))


def test_replica_piece_is_a_row_of_a_stacked_tensor() -> None:
    piece = replica_piece("w", torch.zeros(2, 3), rank=1, world_size=4)
    assert (piece.key, piece.shape, piece.start, piece.end) == ("replica/w", (4, 2, 3), 6, 12)
