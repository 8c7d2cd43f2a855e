"""One step of a pipeline rank's schedule (:mod:`phalanx.pipeline.schedules`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Action"]


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule."""

    kind: Literal["F", "B", "I", "W"]
    """``"F"`` (forward), ``"B"`` (backward), or a backward in two passes: ``"I"`` (the
    gradient of the stage's input, sent to the stage before) then ``"W"`` (its weights')."""
    microbatch: int
    """Index of the micro-batch, ``0 <= microbatch < m``."""
    chunk: int = 0
    """Local model-chunk index on this rank (0 unless interleaved)."""

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")
