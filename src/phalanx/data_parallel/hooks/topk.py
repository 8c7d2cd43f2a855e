"""Top-k gradient sparsification with error feedback.

Each rank sends only the k = ⌈ratio·n⌉ entries of largest magnitude of its bucket (values and
indices, gathered from every rank) and keeps the rest as a local error that is added to the next
step's gradient, so every coordinate is eventually applied: Stich, Cordonnier & Jaggi, "Sparsified
SGD with Memory", NeurIPS 2018; Lin et al., "Deep Gradient Compression", ICLR 2018. With error
feedback, SGD converges at the rate of uncompressed SGD (Stich et al., Theorem 2.4).
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from phalanx.comm import collectives as c
from phalanx.data_parallel.grad_bucket import GradBucket
from phalanx.data_parallel.hooks.default import allreduce_future, ddp_compatible

__all__ = ["TopKState", "topk_hook", "topk_select"]

log = logging.getLogger(__name__)


class TopKState:
    """Settings and per-bucket error memory of :func:`topk_hook`.

    Args:
        process_group: Group to average over; None for the default group.
        ratio: Fraction of each bucket's entries a rank sends, in (0, 1].
        start_iter: Iterations of plain all-reduce before sparsifying (warm-up, as in DGC).
        use_error_feedback: Keep what was not sent and add it to the next step's gradient.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        ratio: float = 0.01,
        start_iter: int = 10,
        use_error_feedback: bool = True,
    ) -> None:
        if not 0 < ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got ratio={ratio!r}")
        if start_iter < 0:
            raise ValueError(f"start_iter must be >= 0, got start_iter={start_iter!r}")
        self.process_group = process_group
        self.ratio = ratio
        self.start_iter = start_iter
        self.use_error_feedback = use_error_feedback
        self.iter = 0
        self.error_dict: dict[int, torch.Tensor] = {}

    def k_for(self, numel: int) -> int:
        """Number of entries a rank sends from a bucket of ``numel`` entries."""
        return min(numel, math.ceil(self.ratio * numel))

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        """Count one iteration when the last bucket of a backward pass has been handed over."""
        if bucket.is_last():
            self.iter += 1


def topk_select(acc: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` entries of the 1-D ``acc`` with the largest magnitude: (values, indices)."""
    if not 0 <= k <= acc.numel():
        raise ValueError(f"k must be in 0..{acc.numel()} (the tensor's size), got k={k}")
    indices = torch.topk(acc.abs(), k, sorted=False).indices
    return acc[indices], indices


@ddp_compatible
def topk_hook(state: TopKState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket's gradients from each rank's top-k entries (plus error feedback).

    Plain all-reduce for the first ``state.start_iter`` iterations. Then every rank sends k
    values and k indices (one all-gather each); the result is the sum of all ranks' sparse
    contributions divided by the group size, identical on every rank. The collectives run
    synchronously and the returned future is already complete.

    Args:
        state: Settings and per-bucket memory, shared by every call of the hook.
        bucket: The bucket of local gradients.

    Returns:
        A future whose value is the averaged (sparsified) buffer.
    """
    sparsify = state.iter >= state.start_iter
    state.maybe_increase_iter(bucket)
    buffer = bucket.buffer()
    if not sparsify:
        return allreduce_future(state.process_group, buffer)
    _sparse_average(state, bucket.index(), buffer)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buffer)
    return fut


def _sparse_average(state: TopKState, index: int, buffer: torch.Tensor) -> None:
    """Replace ``buffer`` (local gradients) by the mean of every rank's top-k, in place."""
    group, size = state.process_group, dist.get_world_size(state.process_group)
    acc = _accumulate(state, index, buffer)  # g + e: the error buffer itself, or the buffer
    values, indices = topk_select(acc, state.k_for(acc.numel()))
    # int32 indices when they fit: 8 bytes per fp32 entry sent instead of 12 with int64.
    fits = acc.numel() <= torch.iinfo(torch.int32).max
    sent = indices.to(torch.int32) if fits else indices
    all_values = values.new_empty(size * values.numel())
    all_indices = sent.new_empty(size * sent.numel())
    works = [
        c.all_gather_into_tensor(all_values, values, group, async_op=True),
        c.all_gather_into_tensor(all_indices, sent, group, async_op=True),
    ]
    if state.use_error_feedback:
        acc.index_fill_(0, indices, 0)  # e = acc − what this rank sent
    for work in works:
        work.wait()
    buffer.zero_().index_add_(0, all_indices, all_values).div_(size)


def _accumulate(state: TopKState, index: int, buffer: torch.Tensor) -> torch.Tensor:
    if not state.use_error_feedback:
        return buffer
    error = state.error_dict.get(index)
    if error is None or error.shape != buffer.shape:
        if error is not None:
            log.warning("top-k: bucket %d changed size; its error memory restarts", index)
        error = state.error_dict[index] = torch.zeros_like(buffer)
    return error.add_(buffer)
