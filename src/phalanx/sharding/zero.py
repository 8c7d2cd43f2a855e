"""ZeRO stages 1 and 2: optimizer state (and, in stage 2, gradients) sharded across ranks.

Rajbhandari et al. 2019, §5 (P_os, P_os+g). The parameters become views into one flat buffer
laid out in buckets (:mod:`phalanx.sharding.layout`); each bucket is split into one balanced
contiguous range per rank. A rank steps a wrapped ``torch.optim`` optimizer over its ranges
only, so its state is KΨ/N bytes.

- **Stage 1**: ``step()`` reduce-scatters the gradients bucket by bucket (Ψ elements), steps
  the shard and all-gathers the updated parameters (Ψ): 2Ψ per step, DDP's volume.
- **Stage 2**: the reduce-scatter runs *during backward*, from gradient hooks, overlapped with
  the rest of backward like DDP's all-reduce; each parameter's full gradient is freed as soon as
  it is copied, so a rank keeps 4Ψ/N bytes of gradient plus the buckets in flight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.comm import collectives as c
from phalanx.sharding import zero_state
from phalanx.sharding.grad_sync import ShardSync
from phalanx.sharding.layout import ShardLayout, plan_shards
from phalanx.sharding.state import PieceReader, ShardedState

__all__ = ["ZeroRedundancyOptimizer", "check_elementwise"]

NOT_ELEMENTWISE = {
    "LBFGS": "it needs the whole parameter vector and a closure",
    "Adafactor": "it factors each matrix's second moment by rows and columns",
    "Muon": "it orthogonalises each weight matrix",
    "SparseAdam": "it steps sparse gradients",
}


def check_elementwise(cls: type) -> None:
    """Refuse optimizers that need whole tensors: a flat shard is a 1-D slice of several."""
    why = NOT_ELEMENTWISE.get(cls.__name__)
    if why is not None and cls.__module__.startswith("torch.optim"):
        raise ValueError(
            f"optimizer_class={cls.__name__} cannot step a ZeRO shard: {why}, while a shard is "
            f"a flat slice of the parameters; use an element-wise optimizer (SGD, Adam, AdamW, "
            f"Adagrad, RMSprop, ...) or strategy='ddp'"
        )


def _groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    items = list(params)
    if not items:
        raise ValueError("ZeroRedundancyOptimizer: params is empty")
    groups = [dict(g) for g in items] if isinstance(items[0], dict) else [{"params": items}]
    for g in groups:
        if "params" not in g:
            raise ValueError(f"ZeroRedundancyOptimizer: a parameter group has no 'params': {g}")
        ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        g["params"] = [p for p in ps if p.requires_grad]
    return groups


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """Shard any element-wise ``torch.optim`` optimizer across the data-parallel group.

    Args:
        params: Parameters or parameter groups (dicts with ``params`` and per-group options),
            as for any optimizer; all of one floating dtype and device.
        optimizer_class: e.g. ``torch.optim.AdamW``.
        process_group: The data-parallel group (default: the world).
        stage: 1 (shard optimizer state) or 2 (also shard gradients, reduced during backward).
        bucket_cap_mb: Bucket size for the reduce-scatter / all-gather pipeline.
        **defaults: Passed to ``optimizer_class``.

    Use without DDP (this optimizer averages the gradients itself): ``loss.backward()`` then
    ``opt.step()``. Clip with :meth:`clip_grad_norm_` (the norm spans every rank's shard);
    accumulate with :meth:`no_sync`. The optimizer must update each element from that
    element's own gradient and state (SGD, Adam, AdamW, Adagrad, RMSprop, ...): each rank sees
    a slice of the flattened parameters, not whole tensors.
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[torch.optim.Optimizer],
        process_group: dist.ProcessGroup | None = None,
        *,
        stage: int = 1,
        bucket_cap_mb: float = 25.0,
        **defaults: Any,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(
                f"stage must be 1 or 2 (stage 3 is FullyShardedDataParallel), got {stage!r}"
            )
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb!r}")
        if not (
            isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
        ):
            raise TypeError(
                f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}"
            )
        check_elementwise(optimizer_class)
        groups = _groups(params)
        self.params: list[nn.Parameter] = [p for g in groups for p in g["params"]]
        if not self.params:
            raise ValueError("ZeroRedundancyOptimizer: no parameter requires grad")
        kinds = {(p.dtype, p.device) for p in self.params}
        if len(kinds) != 1:
            raise ValueError(f"all parameters must share one dtype and device, got {kinds}")
        self.stage = stage
        self.process_group = process_group
        self.world = dist.get_world_size(process_group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(process_group) if dist.is_initialized() else 0
        p0 = self.params[0]
        self.layout: ShardLayout = plan_shards(
            [[p.numel() for p in g["params"]] for g in groups],
            self.world,
            p0.element_size(),
            int(bucket_cap_mb * 1024 * 1024),
        )
        self.flat = self._flatten_into_views()
        self._broadcast_from_rank0()
        self.shards = [
            nn.Parameter(self.flat[slice(*b.shard(self.rank))]) for b in self.layout.buckets
        ]
        inner = []
        for gi, g in enumerate(groups):
            opts = {k: v for k, v in g.items() if k != "params"}
            own = [s for s, b in zip(self.shards, self.layout.buckets) if b.group == gi]
            inner.append({**opts, "params": own})
        self.optim = optimizer_class(inner, **defaults)
        super().__init__(self.optim.param_groups, self.optim.defaults)
        self.state = self.optim.state
        self._sync = ShardSync(
            self.params, self.shards, self.flat, self.layout, process_group, self.rank, stage
        )

    def _flatten_into_views(self) -> torch.Tensor:
        p0 = self.params[0]
        flat = torch.empty(self.layout.total, dtype=p0.dtype, device=p0.device)
        for b in self.layout.buckets:
            for index, off in zip(b.params, b.offsets):
                p = self.params[index]
                view = flat[b.flat_offset + off : b.flat_offset + off + p.numel()]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)
        return flat

    def _broadcast_from_rank0(self) -> None:
        if self.world > 1:
            root = dist.get_global_rank(self.process_group, 0) if self.process_group else 0
            c.broadcast(self.flat, root, self.process_group)

    # ---- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Average the gradients into the shards, step them, all-gather the parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync.ensure_reduced()
        self.optim.step()
        self._sync.gather_params()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients and this rank's gradient shards."""
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self._sync.zero_grad()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the averaged gradients by their norm over all ranks' shards; return the norm.

        Call after backward and before :meth:`step` (it reduces the gradients first when stage 1
        has not yet). Equal to ``torch.nn.utils.clip_grad_norm_`` on the full averaged gradient.
        """
        if not max_norm > 0:
            raise ValueError(f"clip_grad_norm_: max_norm must be positive, got {max_norm!r}")
        self._sync.ensure_reduced()
        grads = [s.grad for s in self.shards if s.grad is not None and s.grad.numel()]
        p0 = self.params[0]
        if norm_type == float("inf"):
            local = max((g.abs().max() for g in grads), default=torch.zeros((), device=p0.device))
            total = local.to(torch.float32).reshape(1).clone()
            c.all_reduce(total, dist.ReduceOp.MAX, self.process_group)
            norm = total[0]
        else:
            local = sum(
                (g.float().abs().pow(norm_type).sum() for g in grads),
                torch.zeros((), device=p0.device),
            )
            total = local.reshape(1).clone()
            c.all_reduce(total, dist.ReduceOp.SUM, self.process_group)
            norm = total[0].pow(1.0 / norm_type)
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return norm

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate full local gradients without communicating."""
        old = self._sync.require_sync
        self._sync.require_sync = False
        try:
            yield
        finally:
            self._sync.require_sync = old

    @property
    def require_backward_grad_sync(self) -> bool:
        """False makes the coming backward accumulate locally (the job API's switch)."""
        return self._sync.require_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._sync.require_sync = bool(value)

    # ---- accounting ----------------------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (only its shards')."""
        return sum(
            t.numel() * t.element_size()
            for state in self.optim.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )

    def grad_bytes(self) -> int:
        """Bytes of gradient shards this rank holds (stage 2 keeps no full gradients)."""
        return self._sync.grad_bytes()

    # ---- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The full optimizer state in ``torch.optim`` format, gathered on every rank.

        Collective: every rank must call it. It loads into a plain optimizer over the same
        parameters (or into this class at any world size).
        """
        return zero_state.full_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``torch.optim``-format state dict (from :meth:`state_dict` or a plain
        optimizer over the same parameters); each rank keeps its shard of it."""
        zero_state.load_full_state_dict(self, state_dict)

    def sharded_state(self) -> ShardedState:
        """This rank's state as world-size-independent pieces (``phalanx.checkpoint``)."""
        return zero_state.sharded_state(self)

    def load_sharded_state(self, meta: dict[str, Any], reader: PieceReader) -> None:
        """Restore from pieces saved at any world size."""
        zero_state.load_sharded_state(self, meta, reader)
