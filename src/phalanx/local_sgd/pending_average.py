"""The mean of tensors over a group, launched now and finished later, in any outer codec.

DiLoCo averages pseudo-gradients; streaming DiLoCo launches the average of one fragment and
keeps training while it travels (:class:`PendingAverage` is the one owner of those works and
:meth:`PendingAverage.wait` their one wait site). The tensors are flattened to float32 and
sent in chunks of at most ``bucket_bytes`` (whole quantisation blocks), every chunk launched
before the first wait:

- ``fp32``: one averaging all-reduce per chunk.
- ``bf16`` / ``int8`` / ``int4`` (:mod:`.quantise`): quantised values cannot be summed on the
  wire (each rank's blocks have their own scales; int8 sums overflow), so every rank
  all-gathers every rank's encoded bytes and decodes and sums them itself, in rank order, in
  float32: the result is bitwise the same on every rank.

With ``weights`` (one per rank, summing to 1: ``late_policy="weighted"``, :mod:`.late`) the
result is ``sum_r weights[r] * tensors_r`` instead of the mean: in fp32 each rank scales its
chunk by its own weight and the chunks are summed; decoded chunks are scaled by their rank's
weight before the sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from phalanx.comm import collectives as C
from phalanx.data_parallel.coalesce import copy_back, flatten
from phalanx.local_sgd.quantise import decode, encode

__all__ = ["PendingAverage", "chunks"]


def chunks(numel: int, block: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """``(start, end)`` element ranges of at most ``bucket_bytes`` of float32 (at least one
    block), each a whole number of blocks but the last."""
    size = max(block, (bucket_bytes // 4) // block * block)
    return [(s, min(s + size, numel)) for s in range(0, numel, size)]


@dataclass
class _Chunk:
    start: int
    end: int
    sent: torch.Tensor
    """What this rank handed to the collective (the chunk, or its encoded bytes)."""
    out: torch.Tensor
    """The all-reduced chunk, or every rank's encoded bytes."""
    work: dist.Work


class PendingAverage:
    """The mean over ``group`` of ``tensors`` (floating point, one device), in flight.

    Args:
        tensors: Replaced by their mean when :meth:`wait` returns (not read again before).
        group: The process group (None: every rank).
        codec: "fp32", "bf16", "int8" or "int4" (:data:`.quantise.CODECS`).
        block: Elements per quantisation scale.
        bucket_bytes: Float32 bytes per chunk.
        weights: Each rank's weight (None: the mean).
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        group: dist.ProcessGroup | None,
        codec: str,
        block: int,
        bucket_bytes: int,
        weights: Sequence[float] | None = None,
    ) -> None:
        self.tensors = list(tensors)
        self.group, self.codec, self.block = group, codec, block
        self.world = dist.get_world_size(group)
        if weights is not None and len(weights) != self.world:
            raise ValueError(f"weights={list(weights)}: one per rank, world size {self.world}")
        self.weights = None if weights is None else list(weights)
        self.flat = flatten(self.tensors, torch.float32) if self.tensors else torch.empty(0)
        self._chunks = [
            self._launch(s, e) for s, e in chunks(self.flat.numel(), block, bucket_bytes)
        ]
        self.sent_bytes = sum(c.sent.numel() * c.sent.element_size() for c in self._chunks)
        """Bytes this rank handed to the collectives."""
        self.done = False

    def _launch(self, start: int, end: int) -> _Chunk:
        piece = self.flat[start:end]
        if self.codec == "fp32":
            op = C.ReduceOp.AVG
            if self.weights is not None:
                piece.mul_(self.weights[dist.get_rank(self.group)])
                op = C.ReduceOp.SUM
            work = C.all_reduce(piece, op, group=self.group, async_op=True)
            return _Chunk(start, end, piece, piece, work)
        raw = encode(piece, self.codec, self.block)
        out = torch.empty(self.world * raw.numel(), dtype=torch.uint8, device=raw.device)
        work = C.all_gather_into_tensor(out, raw, self.group, async_op=True)
        return _Chunk(start, end, raw, out, work)

    def wait(self) -> None:
        """Wait for every chunk and write the means into the tensors (once)."""
        assert not self.done, "PendingAverage.wait() called twice"
        self.done = True
        for c in self._chunks:
            c.work.wait()
            if self.codec != "fp32":
                self.flat[c.start : c.end] = self._decoded_mean(c)
        if self.tensors:
            copy_back(self.flat, self.tensors)

    def _decoded_mean(self, c: _Chunk) -> torch.Tensor:
        size, numel = c.sent.numel(), c.end - c.start
        total = torch.zeros(numel, dtype=torch.float32, device=self.flat.device)
        for r in range(self.world):
            value = decode(c.out[r * size : (r + 1) * size], self.codec, numel, self.block)
            total += value if self.weights is None else value * self.weights[r]
        return total / self.world if self.weights is None else total
