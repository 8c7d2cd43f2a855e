"""Hybrid sharding's pure parts: the host layout, and the errors for bad input."""

from __future__ import annotations

import pytest
import torch

import phalanx
from phalanx.comm.group import World
from phalanx.sharding.hybrid import host_plan, make_hybrid_groups, shard_backends
from phalanx.sharding.zero_params import check_replicate
from phalanx.train.live_rules import check_strategy


def test_two_hosts_of_two_shard_inside_and_replicate_across() -> None:
    plan = host_plan([0, 0, 1, 1])
    assert plan.shards == [[0, 1], [2, 3]]
    assert plan.replicas == [[0, 2], [1, 3]]
    assert (plan.hosts, plan.per_host, plan.describe()) == (2, 2, "2 hosts x 2 ranks")
    assert [plan.place(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_ranks_need_not_be_numbered_host_by_host() -> None:
    plan = host_plan([5, 3, 5, 3, 5, 3])  # round-robin placement, arbitrary node ids
    assert plan.shards == [[0, 2, 4], [1, 3, 5]]  # hosts in the order of their first rank
    assert plan.replicas == [[0, 1], [2, 3], [4, 5]]


@pytest.mark.parametrize(
    ("nodes", "shards", "replicas"),
    [
        ([0, 0, 0, 0], [[0, 1, 2, 3]], [[0], [1], [2], [3]]),
        ([0, 1, 2], [[0], [1], [2]], [[0, 1, 2]]),
    ],
    ids=["one-host", "one-rank-per-host"],
)
def test_degenerate_layouts(nodes: list[int], shards: object, replicas: object) -> None:
    plan = host_plan(nodes)
    assert (plan.shards, plan.replicas) == (shards, replicas)


def test_unequal_hosts_are_refused_naming_each_host() -> None:
    with pytest.raises(ValueError, match=r"node 0: ranks \[0, 1, 2\]; node 1: ranks \[3\]"):
        host_plan([0, 0, 0, 1])


def test_world_not_a_multiple_of_the_host_size_is_refused() -> None:
    world = World(0, 3, 0, 2, 0, torch.device("cpu"), "gloo")
    with pytest.raises(ValueError, match=r"world_size=3 is not a multiple .*LOCAL_WORLD_SIZE=2"):
        make_hybrid_groups(world)


def test_zero_shard_option_is_checked() -> None:
    assert phalanx.Zero(stage=3, shard="host").shard == "host"
    assert phalanx.Zero().shard == "world"
    with pytest.raises(
        ValueError, match=r"Zero\(shard='node'\): shard must be one of 'world', 'host'"
    ):
        phalanx.Zero(stage=3, shard="node")
    with pytest.raises(TypeError, match=r"Zero\(shard=2\)"):
        phalanx.Zero(shard=2)  # type: ignore[arg-type]


def test_hybrid_zero_needs_its_own_gradient_averaging_and_no_live_recovery() -> None:
    with pytest.raises(ValueError, match=r"replicate_group=.*needs stage=1 or stage=2"):
        check_replicate(None, object())
    check_replicate(2, object())
    with pytest.raises(ValueError, match=r"recovery='live'.*shard='host'"):
        check_strategy(phalanx.Zero(stage=3, shard="host"), 1, exact=False)


def test_backends_shm_inside_gloo_across_unless_the_user_chose_gloo(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PHALANX_BACKEND", raising=False)
    assert shard_backends(torch.device("cpu"))[1] == "gloo"
    assert shard_backends(torch.device("cuda", 0)) == ("nccl", "nccl")
    monkeypatch.setenv("PHALANX_BACKEND", "gloo")  # phalanx run --backend gloo: no shm
    assert shard_backends(torch.device("cpu")) == ("gloo", "gloo")
