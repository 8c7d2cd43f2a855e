"""``Job(recovery=...)``'s rules and the live job's pure parts (shards, peer failures)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch import nn

import phalanx
from phalanx.data.elastic_sampler import ElasticSampler
from phalanx.train.live import is_peer_failure
from phalanx.train.live_shards import ShardBatches, owned_shards
from phalanx.train.live_zero import LiveShards


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


def test_shard_batches_deal_the_owned_shards_of_each_step() -> None:
    sampler = ElasticSampler(range(50), 8, 4, 0, shuffle=True, seed=3)
    batches = ShardBatches(sampler, owned_shards(4, 3, 0))  # shards 0 and 1
    got = list(batches)
    plans = list(sampler.plans())
    assert len(got) == len(batches) == 2 * len(plans) == 14
    for i, plan in enumerate(plans):
        assert got[2 * i] == sampler.indices(plan, 0)
        assert got[2 * i + 1] == sampler.indices(plan, 1)


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


class _Job:
    step_count = 7


def test_a_failure_that_loses_nobody_is_redone_twice_then_raised() -> None:
    from phalanx.recovery import RecoveryError
    from phalanx.train.live import MAX_IDLE_RECOVERIES, LiveTraining

    failure = RuntimeError("Connection reset by peer")
    live = LiveTraining(_Group([True, False, False, True, False, False, False]), 3)  # type: ignore[arg-type]
    job = _Job()
    live._recover(job, failure)  # type: ignore[arg-type]  # a member lost
    for _ in range(MAX_IDLE_RECOVERIES - 1):
        live._recover(job, failure)  # type: ignore[arg-type]  # nobody lost: redo
    live._recover(job, failure)  # type: ignore[arg-type]  # a loss resets the count
    live._recover(job, failure)  # type: ignore[arg-type]
    live._recover(job, failure)  # type: ignore[arg-type]
    with pytest.raises(RecoveryError, match=r"step 7 failed 3 times in a row.*Connection reset"):
        live._recover(job, failure)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a bug"):
        live._recover(job, ValueError("a bug"))  # type: ignore[arg-type]


def test_a_zero3_forward_outside_forward_backward_is_refused_while_training() -> None:
    # Only job.forward_backward can redo ZeRO-3's forward (it gathers parameters) after a loss.
    shards, model = LiveShards(), nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"loss = job.forward_backward\(inputs, targets\)"):
        shards.check_forward(model, ())
    with LiveShards.forwarding(shards):
        shards.check_forward(model, ())
    shards.check_forward(model.eval(), ())  # evaluation may call the model
