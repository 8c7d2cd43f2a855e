"""Shards restored for a newcomer and re-sharded in place: what a live ZeRO job does on growth.

Ranks 0..2 train a small model under ZeRO-2 or ZeRO-3 over a group of three, with a
ShardMirror refreshed every 2 steps; after step 3 they ``take`` a snapshot of it. Rank 3 then
joins as a newcomer (no mirror; its ZeRO objects built over the world without any broadcast),
and all four call ``restore_shards`` and ``RestoredShards.regroup``: the trainers re-shard their
own objects in place over the world. Every rank must then hold, bit for bit, the state the
three had at step 3 (``take`` made step 3 restorable although the last refresh was at step 2),
and a step at four ranks must train (the objects' hooks and groups rewired).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from phalanx.recovery import ShardMirror, restore_shards
from phalanx.sharding import ZeroRedundancyOptimizer
from phalanx.sharding.zero3 import FullyShardedDataParallel
from phalanx.testing import run_distributed
from tests.distributed.test_peer_shards import LR, STEPS, _assert_equal, _build, _full, _Net, _step


def _newcomer(stage: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A replacement's objects: another initialisation, built over the world, silently."""
    torch.manual_seed(99)
    net = _Net()
    if stage == 3:
        model = FullyShardedDataParallel(net, sync_module_states=False)
        return model, torch.optim.Adam(model.parameters(), lr=LR)
    zero = ZeroRedundancyOptimizer(
        net.parameters(), torch.optim.Adam, stage=2, broadcast_params=False, lr=LR
    )
    return net, zero


def _grow(stage: int) -> dict[str, Any]:
    rank = dist.get_rank()
    three = dist.new_group([0, 1, 2])
    exchange = dist.new_group([0, 1, 2], backend="gloo")  # every rank makes both groups
    mirror, ref, held = None, None, []
    if rank < 3:
        model, opt = _build(stage, three)
        mirror = ShardMirror(opt, model if stage == 3 else None, every=2, exchange_group=exchange)
        for step in range(1, STEPS + 1):
            _step(model, opt, step, three)
            mirror.after_step(step)
        ref = _full(model, opt, stage, three)
        mirror.take(STEPS)
        held = [s.step for s in mirror.own]
    else:
        model, opt = _newcomer(stage)
    restored = restore_shards(mirror, [], None)
    restored.regroup(opt, model if stage == 3 else None)
    got = _full(model, opt, stage, None)
    before = {k: v.clone() for k, v in got["params"].items()}
    _step(model, opt, STEPS + 1, None)
    after = _full(model, opt, stage, None)["params"]
    return {
        "step": restored.step,
        "held": held,
        "ref": ref,
        "got": got,
        "before": before,
        "after": after,
    }


@pytest.mark.parametrize("stage", [2, 3])
def test_a_newcomer_receives_every_shard_and_the_others_reshard_in_place(stage: int) -> None:
    results = run_distributed(_grow, stage, world_size=4, timeout=90)
    ref = results[0]["ref"]
    assert ref["optim"], "Adam state was restored (not empty)"
    for rank, out in enumerate(results):
        assert out["step"] == STEPS, rank
        assert out["held"] == ([2, STEPS] if rank < 3 else []), rank
        _assert_equal(out["got"], ref, f"rank {rank}")
        _assert_equal(out["after"], results[0]["after"], f"rank {rank} after a step at 4")
        assert not torch.equal(out["after"]["c.weight"], out["before"]["c.weight"])


def _alone() -> tuple[int, list[int], list[int]]:
    model, opt = _build(2, None)
    mirror = ShardMirror(opt)
    for step in (1, 2):
        _step(model, opt, step, None)
        mirror.after_step(step)
    return (
        restore_shards(mirror, [], None).step,
        [s.step for s in mirror.own],
        [s.step for s in mirror.mirrors],
    )


def test_a_group_of_one_keeps_its_own_snapshots() -> None:
    assert run_distributed(_alone, world_size=1, timeout=60) == [(2, [1, 2], [])]


def _take_must_grow() -> str:
    model, opt = _build(2, None)
    mirror = ShardMirror(opt)
    _step(model, opt, 1, None)
    mirror.after_step(1)
    mirror.take(1)  # the newest already: nothing
    try:
        mirror.take(0)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def test_take_refuses_an_older_step() -> None:
    assert run_distributed(_take_must_grow, world_size=1, timeout=60) == [
        "ShardMirror.take: step must grow, got 0 after 1"
    ]
