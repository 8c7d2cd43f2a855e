"""``Job(recovery=...)``'s rules and the live job's parts that need no peers (shards, peer failures,
the loop over its loader at a fixed membership)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

import phalanx
from phalanx.train.job_data import LoaderArgs
from phalanx.train.live import LiveTraining, is_peer_failure
from phalanx.train.live_shards import owned_shards
from phalanx.train.live_zero import LiveShards
from phalanx.train.train_state import TrainState


def test_bad_recovery_names_the_argument_and_the_value() -> None:
    with pytest.raises(ValueError, match=r"recovery.*'sometimes'"):
        phalanx.Job("ddp", recovery="sometimes")


def test_live_recovery_refuses_other_strategies_and_accumulation() -> None:
    with pytest.raises(ValueError, match=r"strategy=Hogwild\(.*supports phalanx.DDP\(\) and"):
        phalanx.Job("hogwild", recovery="live")
    with pytest.raises(ValueError, match=r"'live-exact'.*strategy=Zero\(stage=2.*only DDP"):
        phalanx.Job("zero2", recovery="live-exact")
    with pytest.raises(ValueError, match=r"grad_accum=2.*use grad_accum=1"):
        phalanx.Job("ddp", recovery="live", grad_accum=2)


@pytest.mark.parametrize(("shards", "world"), [(4, 4), (4, 3), (4, 2), (4, 1), (5, 3)])
def test_every_shard_is_owned_once_contiguously(shards: int, world: int) -> None:
    owned = [owned_shards(shards, world, r) for r in range(world)]
    assert [v for part in owned for v in part] == list(range(shards))
    assert max(map(len, owned)) - min(map(len, owned)) <= 1


class _Member:
    """What the live loop uses of a LiveGroup when nobody joins or leaves."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def admit(self, before_change: object) -> bool:
        return False


def _live_job(rank: int = 0, world: int = 1, launched: int = 2, exact: bool = False) -> Any:
    """A LiveTraining over a group that never changes, bound to a stand-in runner and a
    training state inside ``Job.epochs()``."""
    live = LiveTraining(_Member(rank, world), launched, exact)  # type: ignore[arg-type]
    runner = SimpleNamespace(model=None, step=lambda optimizer, precision: True)
    state = TrainState(precision=None, epochs_driven=True)  # type: ignore[arg-type]
    live.bind(runner, state, None)  # type: ignore[arg-type]
    return SimpleNamespace(live=live, state=state)


def _loader(job: Any, data: Any = range(20)) -> DataLoader[Any]:
    """``job.loader(data, batch_size=2, shuffle=False)`` of a live job."""
    return job.live.loader(LoaderArgs(data, 2, False, False, True, 0), None)


def _train(job: Any, loader: DataLoader[Any], steps: int | None = None) -> list[list[int]]:
    """A plain loop over ``loader`` (a step per batch), for ``steps`` batches or to the end."""
    seen = []
    for batch in loader:
        seen.append(batch.tolist())
        job.live.step_optimizer(None)
        if len(seen) == steps:
            break
    return seen


def test_a_plain_loop_over_the_live_loader_trains_each_step_of_the_epoch_once() -> None:
    job = _live_job()  # one member of a job launched with two: 4 samples a step
    loader = _loader(job)
    assert len(loader) == 5
    assert _train(job, loader) == [[4 * s + i for i in range(4)] for s in range(5)]
    assert job.state.sampler.epoch == 1 and job.state.step == 0  # the Job counts its steps
    assert _train(job, loader) == []  # the epoch is over until Job.epochs() moves the job on
    job.state.epoch = 1
    assert len(_train(job, loader)) == 5 and job.live.ledger.problems() == []
    assert job.live.ledger.epochs == [0, 1]


def test_a_loader_made_again_goes_on_from_the_previous_ones_place() -> None:
    job = _live_job(rank=1, world=2, launched=2, exact=True)  # shard 1 of each step
    first = _loader(job)
    assert _train(job, first, steps=2) == [[2, 3], [6, 7]]
    again = _loader(job)  # made again inside the epoch loop
    assert _train(job, again) == [[10, 11], [14, 15], [18, 19]]
    with pytest.raises(ValueError, match=r"replaced by a newer job.loader\(...\)"):
        _train(job, first)
    with pytest.raises(ValueError, match=r"dataset_len.*make evaluation loaders with eval=True"):
        _loader(job, range(12))


def test_a_batch_asked_for_before_its_step_is_refused_naming_the_fix() -> None:
    job = _live_job()
    batches = iter(_loader(job))
    next(batches)
    with pytest.raises(ValueError, match=r"call job.step\(\) after every batch.*num_workers=0"):
        next(batches)  # as a DataLoader's workers read ahead


def test_a_step_without_a_batch_of_the_live_loader_is_refused() -> None:
    job = _live_job()
    with pytest.raises(ValueError, match=r"job.step\(\) without a batch of job.loader"):
        job.live.step_optimizer(None)
    _train(job, _loader(job), steps=1)
    with pytest.raises(ValueError, match=r"steps once per batch"):
        job.live.step_optimizer(None)  # twice for one batch


def test_peer_failures_are_told_from_bugs() -> None:
    assert is_peer_failure(dist.DistBackendError("anything"))
    assert is_peer_failure(RuntimeError("[pair.cc:537] Read error: Connection reset by peer"))
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_peer_failure(ValueError("Connection"))


class _Group:
    """What ``LiveTraining._recover`` uses of a LiveGroup: recover() that may lose members."""

    def __init__(self, losses: list[bool]) -> None:
        self.members, self.losses = ("a", "b", "c"), list(losses)
        self.rank, self.generation = 0, 0

    def recover(self, error: BaseException) -> None:
        self.generation += 1
        if self.losses.pop(0):
            self.members = self.members[:-1]


def test_a_failure_that_loses_nobody_is_redone_twice_then_raised() -> None:
    from phalanx.recovery import RecoveryError
    from phalanx.train.live import MAX_IDLE_RECOVERIES, LiveTraining

    failure = RuntimeError("Connection reset by peer")
    live = LiveTraining(_Group([True, False, False, True, False, False, False]), 3)  # type: ignore[arg-type]
    live.bind(SimpleNamespace(), TrainState(None, step=7), None)  # type: ignore[arg-type]
    live._recover(failure)  # a member lost
    for _ in range(MAX_IDLE_RECOVERIES - 1):
        live._recover(failure)  # nobody lost: redo
    live._recover(failure)  # a loss resets the count
    live._recover(failure)
    live._recover(failure)
    with pytest.raises(RecoveryError, match=r"step 7 failed 3 times in a row.*Connection reset"):
        live._recover(failure)
    with pytest.raises(ValueError, match="a bug"):
        live._recover(ValueError("a bug"))


def test_a_zero3_forward_outside_forward_backward_is_refused_while_training() -> None:
    # Only job.forward_backward can redo ZeRO-3's forward (it gathers parameters) after a loss.
    shards, model = LiveShards(), nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"loss = job.forward_backward\(inputs, targets\)"):
        shards.check_forward(model, ())
    with LiveShards.forwarding(shards):
        shards.check_forward(model, ())
    shards.check_forward(model.eval(), ())  # evaluation may call the model
