"""ZeRO stage 1: each rank keeps optimizer state only for its partition of the parameters.

Rajbhandari et al. 2019, §5.1 (P_os). The parameters become views into one flat fp32 buffer.
``step()`` reduce-scatters the averaged gradient so each rank receives only its partition's
(Ψ elements moved), steps a wrapped ``torch.optim`` optimizer over that partition alone (so its
state is KΨ/N bytes), and all-gathers the updated parameters (Ψ): 2Ψ per step, the same volume
as DDP's all-reduce, with 1/N of the optimizer memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.comm import collectives as c
from phalanx.sharding.partition import Partition, partition

__all__ = ["ZeroRedundancyOptimizer"]


class ZeroRedundancyOptimizer:
    """Shard any ``torch.optim`` optimizer's state across the data-parallel group (ZeRO-1).

    Args:
        params: The model's parameters (all of one floating dtype and device).
        optimizer_class: e.g. ``torch.optim.AdamW``.
        process_group: The data-parallel group (default: the world).
        **defaults: Passed to ``optimizer_class``.

    Use without DDP (this optimizer averages the gradients itself): ``loss.backward()`` then
    ``opt.step()``; ``zero_grad()`` as usual.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        optimizer_class: type[torch.optim.Optimizer],
        process_group: dist.ProcessGroup | None = None,
        **defaults: Any,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("ZeroRedundancyOptimizer: no parameter requires grad")
        kinds = {(p.dtype, p.device) for p in self.params}
        if len(kinds) != 1:
            raise ValueError(f"all parameters must share one dtype and device, got {kinds}")
        self.group = process_group
        self.world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        total = sum(p.numel() for p in self.params)
        self.layout: Partition = partition(total, self.world)
        self.flat = self._flatten_into_views(total)
        start, end = self.layout.bounds[self.rank]
        self.shard = nn.Parameter(self.flat[start:end])  # a view: steps write into the model
        self.optim = optimizer_class([self.shard], **defaults)
        self._staging = torch.zeros(self.layout.chunk * self.world, dtype=self.flat.dtype)
        self._sync_from_rank0()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's groups (set ``lr`` here, as with any optimizer)."""
        return self.optim.param_groups

    def _flatten_into_views(self, total: int) -> torch.Tensor:
        p0 = self.params[0]
        flat = torch.empty(total, dtype=p0.dtype, device=p0.device)
        offset = 0
        for p in self.params:
            n = p.numel()
            flat[offset : offset + n].copy_(p.detach().reshape(-1))
            p.data = flat[offset : offset + n].view_as(p)
            offset += n
        return flat

    def _sync_from_rank0(self) -> None:
        root = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        c.broadcast(self.flat, root, self.group)

    def _padded(self, source: torch.Tensor) -> torch.Tensor:
        """Lay ``source`` (flat) out as ``world`` equal chunks, each rank's range padded."""
        stage, chunk = self._staging, self.layout.chunk
        stage.zero_()
        for r, (s, e) in enumerate(self.layout.bounds):
            stage[r * chunk : r * chunk + (e - s)].copy_(source[s:e])
        return stage

    def _flat_grad(self) -> torch.Tensor:
        grads = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params
        ]
        return torch.cat(grads)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """Average gradients (reduce-scatter), step this rank's shard, all-gather parameters."""
        if closure is not None:
            raise ValueError("ZeroRedundancyOptimizer.step() does not take a closure")
        start, end = self.layout.bounds[self.rank]
        chunk = self.layout.chunk
        mine = torch.empty(chunk, dtype=self.flat.dtype)
        c.reduce_scatter_tensor(mine, self._padded(self._flat_grad()), group=self.group)
        self.shard.grad = mine[: end - start].div_(self.world)
        self.optim.step()
        self.shard.grad = None
        mine[: end - start].copy_(self.shard.detach())
        c.all_gather_into_tensor(self._staging, mine, group=self.group)
        for r, (s, e) in enumerate(self.layout.bounds):
            self.flat[s:e].copy_(self._staging[r * chunk : r * chunk + (e - s)])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients."""
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (only its partition's)."""
        return sum(
            t.numel() * t.element_size()
            for state in self.optim.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )
