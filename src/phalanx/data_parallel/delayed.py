"""``delay_all_reduce_named_params``: reduce some parameters in one all-reduce, late.

torch's DDP lets a user take parameters out of the buckets and reduce them together, in one
flat all-reduce launched when a chosen parameter's gradient is ready (``param_to_hook_all_reduce``,
typically one near the input, whose gradient comes last). Their gradients are views of one flat
buffer, re-pointed after every forward. Unlike torch's version, which launches the all-reduce
and never waits for it, the wait happens at the end of backward, before the optimizer reads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.comm import collectives as c
from phalanx.data_parallel.grad_access import hook_accumulator
from phalanx.data_parallel.module_state import broadcast_coalesced

__all__ = ["DelayedAllReduce"]


class DelayedAllReduce:
    """One flat gradient buffer for the delayed parameters and its trigger hook."""

    def __init__(
        self,
        params: list[nn.Parameter],
        trigger: nn.Parameter,
        group: dist.ProcessGroup,
        src: int | None,
    ) -> None:
        self.params = params
        self.group = group
        self.buffer = torch.zeros(
            sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device
        )
        self.views = [
            v.view_as(p) for v, p in zip(self.buffer.split([p.numel() for p in params]), params)
        ]
        if src is not None:  # at construction: every rank starts from the root's values
            broadcast_coalesced([p.detach() for p in params], src, group)
        self._work: Any = None
        self._hook = hook_accumulator(trigger, self._launch)
        self.point_grads()

    def point_grads(self) -> None:
        """Make each delayed gradient a view of the buffer (after ``zero_grad(set_to_none)``)."""
        all_none = all(p.grad is None for p in self.params)
        for p, view in zip(self.params, self.views):
            if p.grad is None:
                p.grad = view
                if not all_none:
                    view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
                p.grad = view
        if all_none:
            self.buffer.zero_()

    def _launch(self) -> None:
        if self._work is not None:
            return
        self.buffer.div_(dist.get_world_size(self.group))
        self._work = c.all_reduce(self.buffer, dist.ReduceOp.SUM, self.group, async_op=True)
        torch.autograd.Variable._execution_engine.queue_callback(self._wait)

    def _wait(self) -> None:
        work, self._work = self._work, None
        work.wait()

    def remove(self) -> None:
        """Detach the trigger hook."""
        self._hook[1].remove()
