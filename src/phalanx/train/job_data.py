"""The data side of :class:`phalanx.Job`: a loader over this rank's shard of the dataset."""

from __future__ import annotations

from typing import Any

import torch

from phalanx.comm.group import World
from phalanx.data.sampler import DistributedSampler
from phalanx.mesh.groups import ParallelGroups
from phalanx.train.resume_point import ResumableLoader, ResumePoint

__all__ = ["DataMixin"]


class DataMixin:
    """``Job.loader()``: ranks of one replica read the same samples, replicas different ones."""

    world: World
    seed: int
    groups: ParallelGroups | None
    sampler: DistributedSampler | None
    _resume_point: ResumePoint

    def _replicas(self) -> tuple[int, int] | None:  # parameter servers override
        return None

    def loader(
        self,
        dataset: Any,
        batch_size: int,
        *,
        shuffle: bool = True,
        drop_last: bool = False,
        even_batches: bool = True,
        **kwargs: Any,
    ) -> torch.utils.data.DataLoader[Any]:
        """A DataLoader over this rank's shard (``phalanx.DistributedSampler``).

        Its sampler's position advances as batches are handed out (loop over the loader or
        ``job.progress(loader)``), so :meth:`save` can be called after any step.
        """
        # Ranks of one replica (its pipeline stages, its tensor shards) read the same samples.
        replicas, replica = self.world.world_size, self.world.rank
        if self.groups is not None:
            replicas, replica = self.groups.topology.dp, self.groups.index("dp")
        replicas, replica = self._replicas() or (replicas, replica)
        if "sampler" in kwargs or "batch_sampler" in kwargs:
            raise ValueError("Job.loader() builds its own sampler; drop sampler=/batch_sampler=")
        self.sampler = DistributedSampler(
            dataset,
            num_replicas=replicas,
            rank=replica,
            shuffle=shuffle,
            seed=self.seed,
            drop_last=drop_last,
            even_batches=even_batches,
            batch_size=batch_size,
        )
        self._resume_point.follow(self.sampler)
        return ResumableLoader(
            self._resume_point,
            dataset,
            batch_size=batch_size,
            sampler=self.sampler,
            drop_last=drop_last,
            **kwargs,
        )
