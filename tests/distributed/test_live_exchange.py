"""The live exchange hands the job's common start to the members the set-up's broadcast missed.

A first member that ``Job.setup``'s broadcast of rank 0's model did not reach (a member was lost
in it) holds only its own initialisation: the exchange that settles the next generation puts it
behind every member that holds the start. When nobody holds the start (its root was lost before
the broadcast reached anyone), the first member's own initialisation becomes it.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from phalanx.testing import run_distributed
from phalanx.train.live_state import Held, exchange
from phalanx.train.precision import Precision
from phalanx.train.strategies.base import Runner
from phalanx.train.train_state import TrainState


class _Runner:
    """The part of a runner the exchange reads: its model and optimizer."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def checkpointed(self, saving: bool) -> tuple[nn.Module, None]:
        return self.model, None


def _exchange(started: list[bool], stateful: list[bool]) -> tuple[object, float]:
    """Each rank's model is filled with its rank; returns (the exchange's answer, its weight)."""
    rank = dist.get_rank()
    model = nn.Linear(2, 1)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(rank))
    train = TrainState(Precision("fp32", torch.device("cpu")))
    runner = cast(Runner, _Runner(model))
    moved = exchange(runner, train, stateful[rank], Held(), started=started[rank])
    return moved, float(model.weight[0, 0])


def test_members_the_start_missed_receive_it_from_a_holder() -> None:
    # rank 0 (the broadcast's root) was lost; rank 1 had received its model, 0 and 2 had not
    results = run_distributed(_exchange, [False, True, False], [True, True, True], world_size=3)
    assert [r[0] for r in results] == [(1, [0, 2])] * 3, results
    assert [r[1] for r in results] == [1.0] * 3, results


def test_without_a_holder_of_the_start_the_first_members_initialisation_becomes_it() -> None:
    # nobody holds the start; rank 2 is a replacement without any state
    results = run_distributed(_exchange, [False, False, True], [True, True, False], world_size=3)
    assert [r[0] for r in results] == [(0, [1, 2])] * 3, results
    assert [r[1] for r in results] == [0.0] * 3, results


def test_members_that_all_hold_the_start_exchange_nothing() -> None:
    results = run_distributed(_exchange, [True, True], [True, True], world_size=2)
    assert [r[0] for r in results] == [None, None], results
    assert [r[1] for r in results] == [0.0, 1.0], results
