"""``phalanx.StreamingDiLoCo(...)``: DiLoCo by fragments, overlapped, in few bits.

Douillard et al. 2025 (``phalanx/local_sgd/streaming.py``): the model is cut into
``fragments`` runs of consecutive parameters; fragment ``p`` synchronises every
``sync_every`` steps at its offset (``p·H // fragments`` by default), its pseudo-gradient
travelling (``quantise``: fp32, bf16, int8, int4) during the next ``overlap`` inner steps.
Everything else (checkpoints and exact resume, per-rank replicas) is :class:`DiLoCo`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch.distributed as dist

from phalanx._check import check_int, check_ints, optional, rule
from phalanx.local_sgd import PeriodicSync, Replica
from phalanx.local_sgd.streaming import StreamingDiLoCoSync
from phalanx.train.strategies.base import check_fields
from phalanx.train.strategies.local_sgd import DiLoCo, bucket_bytes

__all__ = ["StreamingDiLoCo"]


def _offsets(name: str, value: object, where: str) -> tuple[int, ...]:
    return tuple(check_ints(name, value, min=0, where=where))


@dataclass(frozen=True)
class StreamingDiLoCo(DiLoCo):
    """DiLoCo whose fragments synchronise on staggered beats, overlapped with inner steps.

    Args (beyond :class:`DiLoCo`'s; its defaults but ``sync_every``, the paper's 100):
        fragments: Runs of consecutive parameters, each synchronised on its own beat (>= 1,
            at most the model's parameter count: checked at ``Job.setup``).
        offsets: Each fragment's step offset in 0..sync_every-1 (None: ``p·H // fragments``).
        overlap: Inner steps each outer average travels during (0 <= overlap < sync_every).

    ``late_policy`` must be "wait": each fragment's beat is a fixed inner step, which a
    round that ends when the first replica gets there would move.
    """

    name: ClassVar[str] = "streaming-diloco"
    sync_every: int = 100
    fragments: int = 4
    offsets: tuple[int, ...] | None = None
    overlap: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        where = type(self).__name__
        check_fields(
            self,
            fragments=rule(check_int, min=1),
            offsets=optional(_offsets),
            overlap=rule(check_int, min=0, max=self.sync_every - 1),
        )
        if self.late_policy != "wait":
            raise ValueError(
                f"{where}(late_policy={self.late_policy!r}): streaming DiLoCo supports only "
                f"late_policy='wait' (its fragments sync on fixed step beats); use "
                f"phalanx.DiLoCo(late_policy='weighted')"
            )
        if self.offsets is None:
            return
        if len(self.offsets) != self.fragments:
            raise ValueError(
                f"{where}(offsets={self.offsets}): one offset per fragment, "
                f"fragments={self.fragments}"
            )
        late = [o for o in self.offsets if o >= self.sync_every]
        if late:
            raise ValueError(
                f"{where}(offsets={self.offsets}): offsets must be < sync_every="
                f"{self.sync_every}, got {late}"
            )

    def make_sync(self, replica: Replica, group: dist.ProcessGroup | None) -> PeriodicSync:
        cap = bucket_bytes(self.bucket_cap_mb)
        return StreamingDiLoCoSync(
            replica,
            group,
            self.sync_every,
            self.outer(),
            cap,
            self.fragments,
            self.offsets,
            self.overlap,
        )
