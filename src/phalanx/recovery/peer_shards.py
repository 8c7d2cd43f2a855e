"""Restore ZeRO state after a lost rank from the survivors' memory, at the new world size, no disk.

Every survivor of a group that ran a :class:`~phalanx.recovery.shard_mirror.ShardMirror` holds
its own snapshot and its right neighbour's. :func:`restore_shards`, on every survivor:

1. joins the exchange in flight and tells the others which steps it holds (own, mirrored);
2. picks the newest step at which every survivor has its own snapshot and every lost rank's
   left neighbour (its holder) has that rank's mirror (:func:`common_step`) — or raises
   :class:`ShardsLost` when two adjacent ranks were lost (a mirror died with its holder);
3. all-gathers those snapshots over the survivors' new group, so every survivor holds every
   old rank's pieces of that step, and wraps them in in-memory
   :class:`~phalanx.sharding.pieces.PieceReader` objects.

:meth:`RestoredShards.load` then fills a ZeRO optimizer (ZeRO-3: a model and its optimizer)
built over the new group through their own ``load_sharded_state``, the path a checkpoint saved
at another world size takes: the survivors re-split the state without reading a checkpoint.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from phalanx._check import check_group, check_int, fail
from phalanx.comm.objects import all_gather_object
from phalanx.recovery.errors import RecoveryError
from phalanx.recovery.shard_mirror import ShardMirror
from phalanx.recovery.shard_snapshot import ALIGN, PARAMS_FORMAT, Snapshot, readers
from phalanx.sharding.optimizer_pieces import optimizer_view
from phalanx.sharding.pieces import PieceReader, param_key
from phalanx.sharding.zero import ZeroRedundancyOptimizer
from phalanx.sharding.zero3 import FullyShardedDataParallel

__all__ = ["RestoredShards", "ShardsLost", "common_step", "restore_shards"]


class ShardsLost(RecoveryError):
    """The survivors' memory does not hold every shard: restore from the newest checkpoint."""


@dataclass
class RestoredShards:
    """Every old rank's pieces of one step, on a survivor; load them with :meth:`load`."""

    step: int
    """The optimizer steps done at the snapshots: roll the data sampler back to it."""
    kind: str
    """``"zero"`` (ZeRO-1/2) or ``"zero3"``."""
    sections: dict[str, tuple[dict[str, Any], PieceReader]]
    """``"model"`` and ``"optimizer"``: meta and a reader, as a checkpoint gives them."""

    def load(
        self, optimizer: torch.optim.Optimizer, model: FullyShardedDataParallel | None = None
    ) -> None:
        """Fill ``optimizer`` (ZeRO-1/2: and its parameters; ZeRO-3: ``model`` too), built
        over the survivors' group, with the restored state."""
        self._check(optimizer, model, "RestoredShards.load")
        if model is not None:
            model.load_sharded_state(*self.sections["model"])
            self._load_zero3_optimizer(optimizer, model)
            return
        assert isinstance(optimizer, ZeroRedundancyOptimizer)
        _load_zero_params(optimizer, *self.sections["model"])
        optimizer.load_sharded_state(*self.sections["optimizer"])

    def regroup(
        self, optimizer: torch.optim.Optimizer, model: FullyShardedDataParallel | None = None
    ) -> None:
        """Re-shard ``optimizer`` (ZeRO-3: and ``model``) in place over the current default
        group, which live recovery replaced, then :meth:`load` the restored state: the same
        objects go on, holding this step's shards at the new size. Collective over the new
        group (ZeRO-1/2's re-planning)."""
        self._check(optimizer, model, "RestoredShards.regroup")
        if model is None:
            assert isinstance(optimizer, ZeroRedundancyOptimizer)
            optimizer.regroup(None)
            self.load(optimizer)
            return
        # FSDP's regroup takes the full state (a rank holds only its shard) and fills the shards.
        _, reader = self.sections["model"]
        full = {key: reader.full(key) for key in reader.keys()}  # noqa: SIM118 (a method)
        model.regroup(None, full, optimizer=optimizer)
        self._load_zero3_optimizer(optimizer, model)

    def _load_zero3_optimizer(
        self, optimizer: torch.optim.Optimizer, model: FullyShardedDataParallel
    ) -> None:
        view = optimizer_view(model, optimizer)
        assert view is not None
        view.load_sharded_state(*self.sections["optimizer"])

    def _check(
        self, optimizer: torch.optim.Optimizer, model: FullyShardedDataParallel | None, where: str
    ) -> None:
        """The objects must be of the restored state's kind (TypeError naming the argument)."""
        if self.kind == "zero3" and not isinstance(model, FullyShardedDataParallel):
            what = "the FullyShardedDataParallel model (the state is ZeRO-3's)"
            raise fail("model", model, what, where=where, error=TypeError)
        if self.kind != "zero3" and (
            model is not None or not isinstance(optimizer, ZeroRedundancyOptimizer)
        ):
            what = "a ZeroRedundancyOptimizer, with model=None (the state is ZeRO-1/2's)"
            raise fail("optimizer", optimizer, what, where=where, error=TypeError)


@torch.no_grad()
def _load_zero_params(
    opt: ZeroRedundancyOptimizer, meta: dict[str, Any], reader: PieceReader
) -> None:
    if meta.get("format") != PARAMS_FORMAT or meta.get("params") != len(opt.params):
        raise ValueError(
            f"RestoredShards.load: the restored state holds {meta.get('params')} parameters, "
            f"the optimizer {len(opt.params)}; build it over the same model"
        )
    for i, p in enumerate(opt.params):
        p.copy_(reader.full(param_key(i)).view_as(p))


def _check_lost(lost: Collection[int], world: int, rank: int) -> list[int]:
    where = "restore_shards"
    if isinstance(lost, (str, bytes)) or not isinstance(lost, Collection):
        raise fail("lost", lost, "a collection of old ranks", where=where, error=TypeError)
    ranks = sorted({check_int("lost", r, min=0, max=world - 1, where=where) for r in lost})
    if rank in ranks:
        raise fail("lost", lost, f"ranks other than this survivor's old rank {rank}", where=where)
    return ranks


def _holder(lost: int, world: int) -> int:
    return (lost - 1) % world  # rank r mirrors rank r + 1


def common_step(reports: list[dict[str, Any]], lost: list[int], world: int) -> int:
    """The newest step every survivor and every lost rank's holder still hold (pure).

    Args:
        reports: One per survivor: ``{"rank": old rank, "own": [steps], "mirror": [steps]}``.
        lost: The lost old ranks, sorted.
        world: The old world size.

    Raises:
        ShardsLost: a lost rank's holder was lost too, or no step is held by all.
        RecoveryError: the reports are not from exactly the old ranks that were not lost.
    """
    survivors = sorted(r["rank"] for r in reports)
    if survivors != [r for r in range(world) if r not in lost]:
        raise RecoveryError(
            f"restore_shards: the new group holds old ranks {survivors}; with {lost} of "
            f"{world} lost it must hold all the others"
        )
    for r in lost:
        if _holder(r, world) in lost:
            raise ShardsLost(
                f"ranks {lost} of {world} were lost, among them adjacent ranks "
                f"{_holder(r, world)} and {r}: rank {r}'s shards were mirrored only on rank "
                f"{_holder(r, world)}; restore from the newest checkpoint"
            )
    steps = set.intersection(*(set(r["own"]) for r in reports))
    for report in reports:
        if (report["rank"] + 1) % world in lost:
            steps &= set(report["mirror"])
    if not steps:
        held = {r["rank"]: (r["own"], r["mirror"]) for r in reports}
        raise ShardsLost(
            f"ranks {lost} of {world} were lost and no step's shards are all held in memory "
            f"(old rank: (own steps, mirrored steps) {held}); restore from the newest checkpoint"
        )
    return max(steps)


def _offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Where each of snapshots of ``sizes`` bytes starts in one buffer (aligned: their pieces
    stay viewable in place), and the buffer's size."""
    starts, at = [], 0
    for n in sizes:
        at = -(-at // ALIGN) * ALIGN
        starts.append(at)
        at += n
    return starts, at


def _gather(
    mine: list[tuple[int, Snapshot]], group: dist.ProcessGroup | None
) -> list[tuple[int, Snapshot]]:
    """Every survivor's ``(old rank, snapshot)`` pairs, on every survivor (bit-exact bytes)."""
    heads = [(rank, s.step, s.manifest, s.nbytes) for rank, s in mine]
    size = dist.get_world_size(group)
    everyone: list[Any] = [None] * size
    all_gather_object(everyone, heads, group)
    width = max(max(_offsets([h[3] for h in heads])[1] for heads in everyone), 1)  # gloo: not 0
    out = [torch.empty(width, dtype=torch.uint8) for _ in range(size)]
    flat = torch.zeros(width, dtype=torch.uint8)
    for at, (_, s) in zip(_offsets([s.nbytes for _, s in mine])[0], mine):
        flat[at : at + s.nbytes].copy_(s.buffer)
    dist.all_gather(out, flat, group=group)
    pairs = []
    for heads, buffer in zip(everyone, out):
        for at, (rank, step, manifest, nbytes) in zip(_offsets([h[3] for h in heads])[0], heads):
            pairs.append((rank, Snapshot(step, manifest, buffer[at : at + nbytes])))
    return pairs


def restore_shards(
    mirror: ShardMirror | None, lost: Collection[int], group: dist.ProcessGroup | None
) -> RestoredShards:
    """Gather every old rank's pieces of the newest common step from the survivors' memory.

    Collective over ``group``: call it on every member, survivors with the same ``lost``.

    Args:
        mirror: This survivor's mirror (it knows the old world size and this rank's old rank),
            or None on a member that held no shards (a replacement that joined): it
            contributes nothing, receives every piece, and its ``lost`` is not read.
        lost: The old ranks (of the mirrors' ZeRO group) that were lost.
        group: The new group: the survivors, and any newcomers, in any order (None: the
            default group).

    Returns:
        The state, and its step; load it with :meth:`RestoredShards.load` into a ZeRO
        optimizer (ZeRO-3: a model and optimizer) built over ``group``, or re-shard the same
        objects in place with :meth:`RestoredShards.regroup`.

    Raises:
        ShardsLost: two adjacent old ranks were lost, or no step is held by all (the message
            says so and names the ranks): restore from the newest checkpoint instead.
    """
    where = "restore_shards"
    group = check_group("group", group, where=where)
    size = dist.get_world_size(group)
    report: dict[str, Any] | None = None
    if mirror is not None:
        _check_mirror(mirror)
        lost_ranks = _check_lost(lost, mirror.world, mirror.rank)
        expected = mirror.world - len(lost_ranks)
        if size < expected:
            what = f"a group of the {expected} survivors (and any newcomers), not of {size} ranks"
            raise fail("group", group, what, where=where)
        mirror.settle()  # an exchange with a lost peer fails; what arrived is kept
        report = {
            "rank": mirror.rank,
            "world": mirror.world,
            "lost": lost_ranks,
            "own": [s.step for s in mirror.own],
            "mirror": [s.step for s in mirror.mirrors],
        }
    everyone: list[Any] = [None] * size
    all_gather_object(everyone, report, group)
    reports = [r for r in everyone if r is not None]
    world, lost_ranks = _agreed(reports)
    step = common_step(reports, lost_ranks, world)
    mine: list[tuple[int, Snapshot]] = []
    if mirror is not None:
        own = mirror.own_at(step)
        assert own is not None
        mine.append((mirror.rank, own))
        if mirror.neighbour in lost_ranks:
            held = mirror.mirror_at(step)
            assert held is not None
            mine.append((mirror.neighbour, held))
    pairs = _gather(mine, group)  # not empty: some member reported
    return RestoredShards(step, str(pairs[0][1].manifest["kind"]), readers(pairs))


def _agreed(reports: list[dict[str, Any]]) -> tuple[int, list[int]]:
    """The old world size and lost ranks every survivor reported (they must agree)."""
    if not reports:
        raise ShardsLost(
            "restore_shards: no member of the group holds shards (every holder was lost, or "
            "only newcomers called it); restore from the newest checkpoint"
        )
    first = reports[0]
    for r in reports[1:]:
        if (r["world"], r["lost"]) != (first["world"], first["lost"]):
            raise RecoveryError(
                f"restore_shards: survivors disagree on what was lost: old rank "
                f"{first['rank']} says {first['lost']} of {first['world']}, old rank "
                f"{r['rank']} says {r['lost']} of {r['world']}"
            )
    return int(first["world"]), list(first["lost"])


def _check_mirror(mirror: object) -> None:
    if not isinstance(mirror, ShardMirror):
        raise fail("mirror", mirror, "a ShardMirror", where="restore_shards", error=TypeError)
