"""dp x pp x tp: the rank layout, its process groups, and composing the three parallelisms.

topo = Topology.for_world(world_size, pp=2, tp=2)     # dp inferred; errors name every degree
groups = make_groups(topo)                             # collective: every rank calls it
model = parallelize(gpt, groups, ParallelConfig(pp=2, tp=2, micro_batches=4), loss_fn)
loss = model.train_step(x, y)                          # gradients averaged over dp
"""

from __future__ import annotations

from phalanx.mesh.config import ParallelConfig
from phalanx.mesh.groups import ParallelGroups, make_groups
from phalanx.mesh.parallelize import ParallelModel, layers_of, parallelize
from phalanx.mesh.replica_average import average_gradients
from phalanx.mesh.topology import AXES, Topology

__all__ = [
    "AXES",
    "ParallelConfig",
    "ParallelGroups",
    "ParallelModel",
    "Topology",
    "average_gradients",
    "layers_of",
    "make_groups",
    "parallelize",
]
