"""Streaming DiLoCo: fragments on staggered beats, the outer all-reduce overlapped with compute.

Douillard et al., "Streaming DiLoCo with overlapping communication" (2025). Fragment ``p``
(:mod:`.fragments`) synchronises after steps ``offset_p + k·H``: its pseudo-gradient is
launched (in the outer codec, :mod:`.pending_average`) and the ranks keep training. After
``overlap`` more inner steps (τ, 0 <= τ < H) the average is waited for, θ of the fragment takes
its outer step, and the fragment's local parameters restart from θ (the paper's mixing factor
α = 0: the τ local steps on that fragment are dropped; the other fragments keep theirs).
Floating-point buffers are averaged with fragment 0, synchronously.

With one fragment, offset 0 and no overlap this is :class:`.DiLoCoSync` exactly. A checkpoint
taken while an average is in flight waits for it and keeps the averaged pseudo-gradient and
the step it applies at, so a resumed job applies it at the same step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from phalanx._check import check_int, check_ints
from phalanx.local_sgd.diloco import DiLoCoSync
from phalanx.local_sgd.fragments import default_offsets, due, split_fragments
from phalanx.local_sgd.outer import Outer
from phalanx.local_sgd.pending_average import PendingAverage
from phalanx.local_sgd.periodic import DEFAULT_BUCKET_BYTES
from phalanx.local_sgd.replicas import Replica

__all__ = ["StreamingDiLoCoSync"]

FLIGHT = "flight/"


@dataclass
class _Flight:
    """A fragment's average on its way: applied after step ``apply_at``."""

    apply_at: int
    deltas: list[torch.Tensor]
    pending: PendingAverage | None
    """None once waited for (or restored from a checkpoint, averaged already)."""

    def averaged(self) -> list[torch.Tensor]:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        return self.deltas


class StreamingDiLoCoSync(DiLoCoSync):
    """DiLoCo over fragments with staggered offsets and overlapped outer averages.

    Args (beyond :class:`.DiLoCoSync`'s):
        fragments: Runs of consecutive parameters synchronised on their own beat (>= 1).
        offsets: Each fragment's offset in 0..H-1 (None: ``p·H // fragments``).
        overlap: Inner steps the outer average travels during (τ, 0 <= τ < H).

    :attr:`steps` counts every optimizer step (not reset: the fragments' beats need it).
    """

    def __init__(
        self,
        replica: Replica,
        group: dist.ProcessGroup | None,
        every: int,
        outer: Outer,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        fragments: int = 1,
        offsets: Sequence[int] | None = None,
        overlap: int = 0,
    ) -> None:
        super().__init__(replica, group, every, outer, bucket_bytes)
        where = type(self).__name__
        count = check_int("fragments", fragments, min=1, where=where)
        self.plan = split_fragments([t.numel() for t in replica.param_tensors], count)
        if offsets is None:
            offsets = default_offsets(self.every, count)
        self.offsets = check_ints("offsets", offsets, min=0, max=self.every - 1, where=where)
        if len(self.offsets) != count:
            raise ValueError(
                f"{where}(offsets={list(self.offsets)}): one offset per fragment, fragments={count}"
            )
        self.overlap = check_int("overlap", overlap, min=0, max=self.every - 1, where=where)
        self.flights: dict[int, _Flight] = {}
        """Fragment -> its average in flight (the one owner of those works)."""

    def after_step(self) -> bool:
        """Apply the averages due now, then launch the fragments whose beat this is."""
        self.steps += 1
        start, sent, launched = time.perf_counter(), 0, 0
        with torch.no_grad():
            finished = [p for p, f in self.flights.items() if f.apply_at == self.steps]
            for p in sorted(finished):
                self._apply(p)
            for p, offset in enumerate(self.offsets):
                if due(self.steps, self.every, offset):
                    sent += self._launch(p)
                    launched += 1
        if launched or finished:
            self.stats.add(sent, time.perf_counter() - start, launched)
        return bool(launched or finished)

    def _launch(self, p: int) -> int:
        indices = self.plan[p]
        deltas = self.pseudo_gradient(indices)
        pending = self.launch(deltas)
        self.flights[p] = _Flight(self.steps + self.overlap, deltas, pending)
        sent = pending.sent_bytes
        if self.overlap == 0:
            self._apply(p)
        return sent + (self.average_buffers() if p == 0 else 0)

    def _apply(self, p: int) -> None:
        self.outer_step(self.plan[p], self.flights.pop(p).averaged())

    def flush(self) -> None:
        """Apply the averages in flight, then average the replicas (:meth:`final_sync`: the end
        of training; every replica then holds θ). Collective; :attr:`steps` goes on."""
        with torch.no_grad():
            for p in sorted(self.flights):
                self._apply(p)
        self._timed(self.final_sync)

    def finish(self) -> None:
        """Wait for the averages in flight; they stay due at their step (a checkpoint taken
        now still applies them where the uninterrupted run would)."""
        for flight in self.flights.values():
            flight.averaged()

    def shared_state(self) -> dict[str, torch.Tensor]:
        """DiLoCo's, plus each flight's averaged pseudo-gradient and the step it applies at
        (waited for here: the values do not change, only when the wait happens)."""
        out = super().shared_state()
        names = [name for name, _ in self.replica.params]
        for p, flight in self.flights.items():
            out[f"{FLIGHT}{p}"] = torch.tensor([flight.apply_at], dtype=torch.int64)
            for i, delta in zip(self.plan[p], flight.averaged()):
                out[f"{FLIGHT}{p}/{names[i]}"] = delta
        return out

    def load_shared_state(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_shared_state(tensors)
        self.flights.clear()
        names = [name for name, _ in self.replica.params]
        for p, indices in enumerate(self.plan):
            if f"{FLIGHT}{p}" not in tensors:
                continue
            deltas = [tensors[f"{FLIGHT}{p}/{names[i]}"].clone() for i in indices]
            self.flights[p] = _Flight(int(tensors[f"{FLIGHT}{p}"][0]), deltas, None)
