"""Parameter-server shard plan: balanced, deterministic, exact flat layout, named errors."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from phalanx.parameter_server import ParamSlot, plan_shards


def test_largest_first_onto_least_loaded() -> None:
    plan = plan_shards([("a", 5), ("b", 9), ("c", 4), ("d", 7), ("e", 3)], 2)
    # LPT by hand: b(9)->0, d(7)->1, a(5)->1 (7<9), c(4)->0 (9<12), e(3)->0 (13 vs 12 -> 1)
    assert [s.name for s in plan.slots(0)] == ["b", "c"]
    assert [s.name for s in plan.slots(1)] == ["a", "d", "e"]
    assert plan.loads() == (13, 15)
    assert plan.slots(1) == (
        ParamSlot("a", 1, 0, 5),
        ParamSlot("d", 1, 5, 7),
        ParamSlot("e", 1, 12, 3),
    )


def test_ties_are_deterministic_and_independent_of_input_order() -> None:
    sizes = [("x", 4), ("y", 4), ("z", 4), ("w", 4)]
    owners = {n: plan_shards(sizes, 3).server_of(n) for n, _ in sizes}
    assert owners == {"w": 0, "x": 1, "y": 2, "z": 0}  # equal sizes by name, equal loads by index
    for perm in itertools.permutations(sizes):
        plan = plan_shards(list(perm), 3)
        assert {n: plan.server_of(n) for n, _ in sizes} == owners


def test_every_parameter_once_layout_contiguous_and_balanced() -> None:
    rng = random.Random(0)
    for trial in range(200):
        n = rng.randint(1, 12)
        sizes = [(f"p{i}", rng.choice([0, 1, 3, 64, 1000, rng.randint(0, 5000)])) for i in range(n)]
        servers = rng.randint(1, n)
        plan = plan_shards(sizes, servers)
        names = sorted(s.name for slots in plan.servers for s in slots)
        assert names == sorted(n for n, _ in sizes), trial
        order = [n for n, _ in sizes]
        for server, slots in enumerate(plan.servers):
            assert slots, f"server {server} owns nothing (trial {trial})"
            assert [s.name for s in slots] == [n for n in order if n in {s.name for s in slots}]
            offset = 0
            for s in slots:
                assert (s.server, s.offset) == (server, offset)
                offset += s.numel
        # LPT guarantee: a server's load exceeds the lightest by at most the largest parameter
        loads = plan.loads()
        assert sum(loads) == sum(sz for _, sz in sizes)
        assert max(loads) - min(loads) <= max(sz for _, sz in sizes)


def test_flatten_unflatten_round_trip_and_views() -> None:
    shapes = {"w": (3, 4), "b": (4,), "e": (2, 2, 2), "s": ()}
    grads = {
        n: torch.randn(shape, generator=torch.Generator().manual_seed(i))
        for i, (n, shape) in enumerate(shapes.items())
    }
    plan = plan_shards([(n, g.numel()) for n, g in grads.items()], 2)
    for server in range(2):
        flat = plan.flatten(grads, server)
        assert flat.shape == (plan.numel(server),)
        views = plan.unflatten(flat, server, shapes)
        assert {s.name for s in plan.slots(server)} == set(views)
        for name, view in views.items():
            assert view.shape == shapes[name]
            assert torch.equal(view, grads[name])  # flatten copies: bit-exact
        flat_views = plan.unflatten(flat, server)
        name = plan.slots(server)[-1].name
        flat_views[name].fill_(7.0)  # writes through: views share flat's storage
        assert flat[-1].item() == 7.0 and flat_views[name].dim() == 1


def test_flatten_and_unflatten_errors() -> None:
    plan = plan_shards([("a", 4), ("b", 3)], 2)
    with pytest.raises(ValueError, match=r"server 0 needs \['a'\], missing"):
        plan.flatten({"b": torch.zeros(3)}, 0)
    with pytest.raises(ValueError, match=r"'b' has 4 elements, the plan says 3 \(server 1\)"):
        plan.flatten({"a": torch.zeros(4), "b": torch.zeros(4)}, 1)
    with pytest.raises(ValueError, match=r"1-D with 4 elements, got shape \(2, 2\)"):
        plan.unflatten(torch.zeros(2, 2), 0)
    with pytest.raises(ValueError, match=r"server must be in \[0, 2\), got 2"):
        plan.slots(2)
    with pytest.raises(KeyError, match="'c' is not in the shard plan"):
        plan.server_of("c")


def test_plan_errors_name_the_values() -> None:
    with pytest.raises(ValueError, match="num_servers must be >= 1, got 0"):
        plan_shards([("a", 1)], 0)
    with pytest.raises(ValueError, match="num_servers=3 is more than the 2 parameters"):
        plan_shards([("a", 1), ("b", 2)], 3)
    with pytest.raises(ValueError, match="names 'a' twice"):
        plan_shards([("a", 1), ("a", 2)], 1)
    with pytest.raises(ValueError, match="'b' has a negative size -2"):
        plan_shards([("a", 1), ("b", -2)], 1)
