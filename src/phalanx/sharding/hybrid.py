"""Hybrid sharding: shard inside each host, replicate across hosts (HSDP, DeepSpeed's hpZ).

With ZeRO over every rank, each all-gather and reduce-scatter of a step crosses the slow link
between machines. Hybrid sharding splits the world into

- a **shard group** per host: the ranks of one machine, which hold one copy of the model
  state between them (1/L each, L ranks per host) and run every per-step gather and
  reduce-scatter over shared memory (``backend="shm"``) or NVLink;
- a **replicate group** per place in a host: the ranks with the same index in their host, one
  per machine, which hold the same shard. After the reduce-scatter inside the host each rank
  all-reduces its gradient shard over its replicate group (gloo across machines), so the
  gradient is the average over the whole world.

Per step a machine sends about Ψ elements across the link (its L shards' all-reduce between
R hosts: 2Ψ(R-1)/R), instead of ZeRO-3's three collectives over every rank. Memory is that of
ZeRO over L ranks (not over the world): the price of keeping the gathers on the machine.

A host is what the launcher says (``phalanx.world().node_rank``: ``GROUP_RANK`` under ``phalanx
run`` and torchrun, ``SLURM_NODEID``...), gathered from every rank once, so ranks need not be
numbered host by host. :func:`host_plan` is the pure layout; :func:`make_hybrid_groups` builds
the groups (collective).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from phalanx.comm import collectives as c
from phalanx.comm.group import World, auto_backend

__all__ = [
    "SHARD_CHOICES",
    "HostPlan",
    "HybridGroups",
    "host_plan",
    "make_hybrid_groups",
    "shard_backends",
]

SHARD_CHOICES = ("world", "host")
"""``Zero(shard=...)``: over every rank (plain ZeRO), or inside each host (hybrid)."""


@dataclass(frozen=True)
class HostPlan:
    """Which ranks shard together and which replicate each other (global ranks)."""

    shards: list[list[int]]
    """One group per host, hosts in the order of their lowest rank, ranks ascending."""
    replicas: list[list[int]]
    """One group per index within a host: that index's rank on every host, in host order."""

    @property
    def hosts(self) -> int:
        """How many hosts (the size of a replicate group)."""
        return len(self.shards)

    @property
    def per_host(self) -> int:
        """Ranks per host (the size of a shard group)."""
        return len(self.shards[0])

    def place(self, rank: int) -> tuple[int, int]:
        """``(host index, index within the host)`` of global ``rank``."""
        for h, members in enumerate(self.shards):
            if rank in members:
                return h, members.index(rank)
        raise ValueError(f"host_plan: rank {rank} is not in the plan of {self.describe()}")

    def describe(self) -> str:
        """``2 hosts x 2 ranks``."""
        hosts, ranks = self.hosts, self.per_host
        return f"{hosts} host{'s' * (hosts != 1)} x {ranks} rank{'s' * (ranks != 1)}"


def host_plan(nodes: Sequence[int]) -> HostPlan:
    """The shard and replicate groups of ranks whose hosts are ``nodes`` (``nodes[r]``: rank
    ``r``'s node rank). Pure.

    Raises:
        ValueError: the hosts hold different numbers of ranks (naming each host's ranks).
    """
    if not nodes:
        raise ValueError("host_plan: no ranks")
    by_node: dict[int, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(int(node), []).append(rank)
    shards = list(by_node.values())  # insertion order: by each host's lowest rank
    sizes = {len(s) for s in shards}
    if len(sizes) != 1:
        held = "; ".join(f"node {n}: ranks {r}" for n, r in by_node.items())
        raise ValueError(
            f"Zero(shard='host') needs the same number of ranks on every host, but {held}; "
            f"start as many ranks on each machine (--nproc-per-node) or use shard='world'"
        )
    replicas = [[s[i] for s in shards] for i in range(len(shards[0]))]
    return HostPlan(shards, replicas)


@dataclass(frozen=True)
class HybridGroups:
    """This rank's shard and replicate groups (:func:`make_hybrid_groups`)."""

    plan: HostPlan
    """The layout of the whole world."""
    shard: dist.ProcessGroup
    """This host's ranks: parameters, gradients and optimizer state are split over them."""
    replicate: dist.ProcessGroup | None
    """This rank's peers on the other hosts (None on one host: nothing to replicate)."""
    shard_backend: str
    """The shard group's backend: shm (CPU), nccl (GPU) or gloo where shm cannot run."""
    replicate_backend: str | None
    """The replicate group's backend: gloo (CPU) or nccl; None without one."""

    def describe(self) -> str:
        """One line: the layout and the backends."""
        across = f", replicate on {self.replicate_backend} across hosts" if self.replicate else ""
        return f"{self.plan.describe()}: shard on {self.shard_backend} inside each host{across}"


def shard_backends(device: torch.device) -> tuple[str, str]:
    """(shard, replicate) backends: NCCL for GPU ranks; for CPU ranks shm inside the host
    (``comm.group.auto_backend``'s rule for ranks sharing a machine) and gloo across, or gloo
    for both where the user opted out of shm (``phalanx run --backend gloo``)."""
    if device.type == "cuda":
        return "nccl", "nccl"
    if os.environ.get("PHALANX_BACKEND", "").lower() == "gloo":
        return "gloo", "gloo"
    return auto_backend(False, one_machine=True)[0], "gloo"


def _gather_nodes(world: World) -> list[int]:
    mine = torch.tensor([world.node_rank], dtype=torch.int64, device=world.device)
    every = torch.empty(world.world_size, dtype=torch.int64, device=world.device)
    c.all_gather_into_tensor(every, mine)
    return [int(n) for n in every.tolist()]


def make_hybrid_groups(world: World) -> HybridGroups:
    """Build every host's shard group and every replicate group; return this rank's.

    Collective over the default group (every rank calls it, in the same order as its other
    ``new_group`` calls): one all-gather of the node ranks, then ``torch.distributed.new_group``
    for each group of :func:`host_plan` in order.

    Raises:
        ValueError: ``world_size`` is not a multiple of ``LOCAL_WORLD_SIZE``, or the hosts hold
            different numbers of ranks (naming the numbers).
    """
    if world.world_size % world.local_world_size:
        raise ValueError(
            f"Zero(shard='host'): world_size={world.world_size} is not a multiple of the ranks "
            f"per host (LOCAL_WORLD_SIZE={world.local_world_size}); start as many ranks on each "
            f"machine or use shard='world'"
        )
    plan = host_plan(_gather_nodes(world) if world.world_size > 1 else [world.node_rank])
    shard_backend, replicate_backend = shard_backends(world.device)
    host, local = plan.place(world.rank)
    shard: dist.ProcessGroup | None = None
    for h, members in enumerate(plan.shards):  # every rank makes every group, in order
        group = dist.new_group(members, backend=shard_backend)
        if h == host:
            shard = group
    replicate: dist.ProcessGroup | None = None
    if plan.hosts > 1:
        for i, members in enumerate(plan.replicas):
            group = dist.new_group(members, backend=replicate_backend)
            if i == local:
                replicate = group
    assert shard is not None
    return HybridGroups(
        plan, shard, replicate, shard_backend, replicate_backend if replicate else None
    )
