"""How to split a model over a dp x pp x tp mesh: degrees, pipeline schedule, tensor-parallel plan.

:class:`ParallelConfig` is the one home of these options and of their checks: ``phalanx.Mesh``
(the job API's strategy) is a ``ParallelConfig`` that also knows how to start, so its fields,
defaults and errors are these. One degree may be None: it takes the ranks the others leave
(:meth:`ParallelConfig.for_world`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from phalanx._check import check_choice, check_int, optional, rule
from phalanx._fields import check_fields
from phalanx.mesh.topology import Topology
from phalanx.pipeline.balance import balance_arg
from phalanx.pipeline.schedules import SCHEDULES

__all__ = ["ParallelConfig"]

DEGREES = ("dp", "pp", "tp")


def _tp_plan(name: str, value: object, where: str) -> object:
    from phalanx.tensor_parallel.plan import plan_arg  # tensor parallelism, only if asked for

    return plan_arg(name, value, where)


_degree = optional(rule(check_int, min=1))


@dataclass(frozen=True)
class ParallelConfig:
    """How to split a model: degrees, pipeline schedule and tensor-parallel plan.

    Checked when built; errors name the class, the field and the value.
    """

    dp: int | None = None
    """Data-parallel degree; None takes what pp and tp leave of the world."""
    pp: int | None = 1
    """Pipeline stages; None takes what dp and tp leave."""
    tp: int | None = 1
    """Tensor-parallel degree; None takes what dp and pp leave."""
    micro_batches: int = 1
    """Micro-batches per step when pipelining (must divide the batch)."""
    schedule: str = "1f1b"
    """Pipeline schedule: "gpipe", "1f1b", "interleaved" or "zbh1"."""
    chunks: int = 1
    """Model chunks per pipeline rank (interleaved schedule only)."""
    balance: Sequence[int] | str | None = None
    """Layers per stage, or "params" / "time"; None balances parameter counts."""
    tp_plan: Mapping[str, str] | None = None
    """Module name -> tensor-parallel style; None uses the model's default plan (GPT has one)."""

    def __post_init__(self) -> None:
        check_fields(
            self,
            dp=_degree,
            pp=_degree,
            tp=_degree,
            micro_batches=rule(check_int, min=1),
            schedule=rule(check_choice, choices=SCHEDULES),
            chunks=rule(check_int, min=1),
            balance=optional(balance_arg),
            tp_plan=optional(_tp_plan),
        )
        left = [k for k in DEGREES if vars(self)[k] is None]
        if len(left) > 1:
            raise ValueError(
                f"{type(self).__name__}({', '.join(f'{k}=None' for k in left)}): at most one "
                f"degree takes the ranks the others leave; give the others"
            )
        if self.pp == 1 and (self.micro_batches > 1 or self.chunks > 1):
            raise ValueError(
                f"micro_batches={self.micro_batches} and chunks={self.chunks} apply to a pipeline, "
                f"but pp=1; set pp > 1 (or use grad_accum for accumulation without a pipeline)"
            )

    def _degrees(self, world_size: int) -> tuple[int | None, int, int]:
        """dp (None: the topology infers it), pp and tp, a free pp or tp given what is left."""
        given = {k: vars(self)[k] for k in DEGREES}
        free = next((k for k in ("pp", "tp") if given[k] is None), None)
        if free is not None:
            others = math.prod(v or 1 for k, v in given.items() if k != free)
            given[free] = max(1, world_size // max(1, others))
        return given["dp"], given["pp"] or 1, given["tp"] or 1

    def for_world(self, world_size: int) -> ParallelConfig:
        """This split on ``world_size`` ranks, with a free pp or tp filled in; checked (errors
        name every degree)."""
        dp, pp, tp = self._degrees(world_size)
        options = {f.name: vars(self)[f.name] for f in fields(ParallelConfig)}
        config = ParallelConfig(**{**options, "dp": dp, "pp": pp, "tp": tp})
        config.topology(world_size)
        return config

    def topology(self, world_size: int) -> Topology:
        """The dp x pp x tp layout of ``world_size`` ranks (errors name every degree)."""
        dp, pp, tp = self._degrees(world_size)
        return Topology.for_world(world_size, dp=dp, pp=pp, tp=tp)
