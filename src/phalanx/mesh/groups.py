"""Process groups for a :class:`~phalanx.mesh.topology.Topology`: one per rank per mesh axis.

``torch.distributed.new_group`` is collective over the *whole* world: every rank must create
every group, in the same order, even the groups it is not in. :func:`make_groups` does exactly
that (axis by axis, groups by lowest rank) and keeps the ones this rank belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from phalanx.mesh.topology import AXES, Topology

__all__ = ["ParallelGroups", "make_groups"]


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's place in a topology and its process group along each axis."""

    topology: Topology
    """The layout the groups were built from."""
    rank: int
    """This rank in the default (world) group."""
    dp: dist.ProcessGroup
    """Replicas of this rank's model shard (gradients are averaged here)."""
    pp: dist.ProcessGroup
    """The pipeline this rank is a stage of (group rank = stage index)."""
    tp: dist.ProcessGroup
    """The ranks this rank's layers are split over."""

    def index(self, axis: str) -> int:
        """This rank's index along ``axis`` (its rank in that group)."""
        return self.topology.coords(self.rank)[axis]

    def group(self, axis: str) -> dist.ProcessGroup:
        """The process group along ``axis`` ("dp", "pp" or "tp")."""
        self.topology.degree(axis)  # validates axis
        group: dist.ProcessGroup = getattr(self, axis)
        return group


def make_groups(topology: Topology, backend: str | None = None) -> ParallelGroups:
    """Create every group of ``topology`` (collective: all ranks call it) and return this rank's.

    Args:
        topology: The layout; its world size must equal the initialised world's.
        backend: Backend of the new groups (default: the world's).
    """
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if topology.world_size != world_size:
        raise ValueError(
            f"make_groups: {topology.describe()} but the process group has "
            f"world_size={world_size}; build the topology with Topology.for_world({world_size}, "
            f"...)"
        )
    mine: dict[str, dist.ProcessGroup] = {}
    for axis in AXES:
        for members in topology.groups(axis):
            group = dist.new_group(members, backend=backend)
            if rank in members:
                mine[axis] = group
    return ParallelGroups(topology, rank, mine["dp"], mine["pp"], mine["tp"])
