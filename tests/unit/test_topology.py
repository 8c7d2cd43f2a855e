"""Topology: the pure dp x pp x tp rank layout (tp innermost, pp outermost)."""

from __future__ import annotations

import pytest

from phalanx.mesh import ParallelConfig, Topology


def test_eight_ranks_layout_matches_the_documented_example() -> None:
    topo = Topology(dp=2, pp=2, tp=2)
    assert topo.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.coords(6) == {"pp": 1, "dp": 1, "tp": 0}


@pytest.mark.parametrize("dp,pp,tp", [(1, 1, 1), (2, 2, 1), (2, 1, 2), (1, 3, 2), (3, 2, 2)])
def test_every_rank_is_in_exactly_one_group_per_dim_and_coords_round_trip(
    dp: int, pp: int, tp: int
) -> None:
    topo = Topology(dp=dp, pp=pp, tp=tp)
    for dim in ("dp", "pp", "tp"):
        groups = topo.groups(dim)
        assert sorted(r for g in groups for r in g) == list(range(topo.world_size))
        assert all(len(g) == topo.degree(dim) for g in groups)
        for g in groups:  # a group's members differ only along dim, in dim order
            assert [topo.coords(r)[dim] for r in g] == list(range(topo.degree(dim)))
    for rank in range(topo.world_size):
        assert topo.rank_of(**topo.coords(rank)) == rank


def test_for_world_infers_dp_and_names_every_degree_when_they_do_not_fit() -> None:
    assert Topology.for_world(8, pp=2, tp=2) == Topology(dp=2, pp=2, tp=2)
    assert Topology.for_world(4, tp=2) == Topology(dp=2, pp=1, tp=2)
    with pytest.raises(ValueError, match=r"dp=3 x pp=2 x tp=1 = 6 .* world_size=4"):
        Topology.for_world(4, dp=3, pp=2)
    with pytest.raises(ValueError, match=r"world_size=6 is not divisible by pp=4 x tp=1"):
        Topology.for_world(6, pp=4)
    with pytest.raises(ValueError, match=r"tp must be an int >= 1, got int 0"):
        Topology.for_world(4, tp=0)
    with pytest.raises(ValueError, match=r"rank 8 is out of range for dp=2 x pp=2 x tp=2"):
        Topology(2, 2, 2).coords(8)


def test_parallel_config_rejects_pipeline_options_without_a_pipeline() -> None:
    with pytest.raises(ValueError, match=r"micro_batches=4 .* pp=1"):
        ParallelConfig(micro_batches=4)
    with pytest.raises(ValueError, match=r"micro_batches must be an int >= 1, got int 0"):
        ParallelConfig(pp=2, micro_batches=0)
    assert ParallelConfig(pp=2, tp=2).topology(8) == Topology(2, 2, 2)
