"""phalanx.Mesh's degrees: the one left None takes the ranks the others leave; errors name them."""

from __future__ import annotations

import pytest
import torch

from phalanx.comm.group import World
from phalanx.mesh import Topology
from phalanx.train.strategies import JobOptions, resolve
from phalanx.train.strategies.mesh import Mesh


def test_the_free_degree_takes_the_ranks_the_others_leave() -> None:
    pipeline, tensor = resolve("pipeline"), resolve("tensor")  # the presets
    assert isinstance(pipeline, Mesh) and isinstance(tensor, Mesh)
    assert pipeline.config(4).topology(4) == Topology(dp=1, pp=4, tp=1)
    assert tensor.config(4).topology(4) == Topology(dp=1, pp=1, tp=4)
    assert Mesh(dp=2, pp=None).config(4).topology(4) == Topology(dp=2, pp=2, tp=1)
    assert Mesh(dp=2, tp=None).config(4).topology(4) == Topology(dp=2, pp=1, tp=2)
    assert Mesh(pp=2, tp=2).config(8).topology(8) == Topology(dp=2, pp=2, tp=2)
    assert Mesh(pp=2).config(4).topology(4) == Topology(dp=2, pp=2, tp=1)


def test_bad_combinations_name_the_values() -> None:
    with pytest.raises(ValueError, match=r"dp=3 x pp=2 x tp=1 = 6 .* world_size=4"):
        Mesh(dp=3, pp=2).config(4)
    with pytest.raises(ValueError, match=r"micro_batches=4 and chunks=1 apply to a pipeline"):
        Mesh(tp=2, micro_batches=4).config(2)


def test_a_pipeline_refuses_grad_accum_before_making_groups() -> None:
    world = World(0, 2, 0, 2, 0, torch.device("cpu"), "gloo")
    with pytest.raises(ValueError, match=r"grad_accum=2 with a pipeline \(pp=2\).*micro_batches"):
        Mesh(pp=2, micro_batches=2).start(world, JobOptions(grad_accum=2))


def test_mesh_options_are_parallel_configs_checked_in_one_place() -> None:
    from dataclasses import fields

    from phalanx.mesh import ParallelConfig

    assert [f.name for f in fields(Mesh)] == [f.name for f in fields(ParallelConfig)]
    mesh = Mesh(dp=2, pp=None, tp=2, micro_batches=2)
    config = mesh.config(8)
    assert type(config) is ParallelConfig and (config.dp, config.pp, config.tp) == (2, 2, 2)
    assert ParallelConfig(dp=2, pp=None, tp=2, micro_batches=2).for_world(8) == config
    # the same checks, named after the class the user built
    with pytest.raises(ValueError, match=r"^ParallelConfig\(pp=None, tp=None\): at most one"):
        ParallelConfig(dp=2, pp=None, tp=None)
    with pytest.raises(ValueError, match=r"^Mesh\(pp=None, tp=None\): at most one"):
        Mesh(dp=2, pp=None, tp=None)
    with pytest.raises(ValueError, match=r"^ParallelConfig\(schedule='zigzag'\)"):
        ParallelConfig(pp=2, schedule="zigzag")
