"""Which rank does what in dp x pp x tp training: a pure, validated rank layout.

The world's ranks are laid out as a 3-D grid ``(pp, dp, tp)``, outermost to innermost, as
torchtitan and Megatron-LM do: tensor-parallel peers are consecutive ranks (on one machine, where
the per-layer all-reduces are cheapest), data-parallel replicas vary next, and pipeline stages
are outermost (their point-to-point traffic is the lightest and tolerates slow links)::

    rank = (pp_index * dp + dp_index) * tp + tp_index

Example, 8 ranks with dp=2, pp=2, tp=2: tensor groups [0,1] [2,3] [4,5] [6,7]; data groups
[0,2] [1,3] [4,6] [5,7]; pipeline groups [0,4] [1,5] [2,6] [3,7].

No process group is touched here; :mod:`phalanx.mesh.groups` builds them from this plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx._check import check_int

__all__ = ["AXES", "Topology"]

AXES = ("pp", "dp", "tp")
"""The grid's axes, outermost first (mesh axes, not tensor dimensions)."""


@dataclass(frozen=True)
class Topology:
    """A dp x pp x tp layout of ``dp * pp * tp`` ranks."""

    dp: int = 1
    """Data-parallel degree: replicas of the (pipelined, tensor-parallel) model."""
    pp: int = 1
    """Pipeline-parallel degree: stages each replica's layers are split into."""
    tp: int = 1
    """Tensor-parallel degree: ranks each layer's matrices are split over."""

    def __post_init__(self) -> None:
        for axis in AXES:
            check_int(axis, getattr(self, axis), min=1, where="Topology")

    @classmethod
    def for_world(
        cls, world_size: int, *, dp: int | None = None, pp: int = 1, tp: int = 1
    ) -> Topology:
        """The layout of ``world_size`` ranks; ``dp=None`` takes what ``pp`` and ``tp`` leave.

        Raises:
            ValueError: naming every degree when they do not multiply to ``world_size``.
        """
        for name, value in (("pp", pp), ("tp", tp)):
            check_int(name, value, min=1, where="Topology")
        if dp is None:
            if world_size % (pp * tp):
                raise ValueError(
                    f"Topology: world_size={world_size} is not divisible by pp={pp} x tp={tp} = "
                    f"{pp * tp}, so no data-parallel degree dp fits; choose pp and tp whose "
                    f"product divides {world_size}"
                )
            dp = world_size // (pp * tp)
        topo = cls(dp=dp, pp=pp, tp=tp)
        if topo.world_size != world_size:
            raise ValueError(
                f"Topology: dp={dp} x pp={pp} x tp={tp} = {topo.world_size} but the job has "
                f"world_size={world_size} ranks; the degrees must multiply to the world size"
            )
        return topo

    @property
    def world_size(self) -> int:
        """``dp * pp * tp``."""
        return self.dp * self.pp * self.tp

    def degree(self, axis: str) -> int:
        """The degree of ``axis`` ("dp", "pp" or "tp")."""
        if axis not in AXES:
            raise ValueError(f"Topology: axis must be one of {AXES}, got {axis!r}")
        return int(getattr(self, axis))

    def coords(self, rank: int) -> dict[str, int]:
        """``{"pp": i, "dp": j, "tp": k}``: where ``rank`` sits in the grid."""
        self._check_rank(rank)
        tp_index = rank % self.tp
        dp_index = (rank // self.tp) % self.dp
        return {"pp": rank // (self.tp * self.dp), "dp": dp_index, "tp": tp_index}

    def rank_of(self, *, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        """The rank at grid coordinates ``(pp, dp, tp)``."""
        for axis, index in (("pp", pp), ("dp", dp), ("tp", tp)):
            if not 0 <= index < self.degree(axis):
                raise ValueError(
                    f"Topology: {axis} index {index} is out of range for {axis}={self.degree(axis)}"
                )
        return (pp * self.dp + dp) * self.tp + tp

    def group_of(self, rank: int, axis: str) -> list[int]:
        """The ranks that share every coordinate of ``rank`` except ``axis``, in ``axis`` order."""
        where = self.coords(rank)
        return [self.rank_of(**{**where, axis: i}) for i in range(self.degree(axis))]

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis``, ordered by their lowest rank (each rank in exactly one)."""
        seen: set[int] = set()
        out: list[list[int]] = []
        for rank in range(self.world_size):
            if rank not in seen:
                members = self.group_of(rank, axis)
                seen.update(members)
                out.append(members)
        return out

    def describe(self) -> str:
        """One line, e.g. ``dp=2 x pp=2 x tp=1 (4 ranks)``."""
        return f"dp={self.dp} x pp={self.pp} x tp={self.tp} ({self.world_size} ranks)"

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"Topology: rank {rank} is out of range for {self.describe()}")
