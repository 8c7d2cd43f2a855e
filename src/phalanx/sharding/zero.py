"""ZeRO stages 1 and 2: optimizer state (and, in stage 2, gradients) sharded across ranks.

Rajbhandari et al. 2019, §5 (P_os, P_os+g). The parameters are laid out in buckets
(:mod:`phalanx.sharding.layout`); each bucket is split into one balanced contiguous range per
rank, and a rank steps a wrapped ``torch.optim`` optimizer over its ranges only
(:mod:`phalanx.sharding.owned`), so its state is KΨ/N bytes. After the step every rank's
updated ranges are all-gathered (:mod:`phalanx.sharding.param_sync`).

Who averages the gradients:

- **stage=None** (the default; torch's contract): the gradients are already averaged, by
  ``DistributedDataParallel`` or by hand, when ``step()`` is called. This is a drop-in for
  ``torch.distributed.optim.ZeroRedundancyOptimizer``: same arguments, same results.
- **stage=1**: no DDP; ``step()`` reduce-scatters the gradients bucket by bucket (Ψ elements),
  steps the ranges and all-gathers the parameters (Ψ): 2Ψ per step, DDP's volume.
- **stage=2**: as stage 1, but the reduce-scatter runs *during backward*, from gradient hooks,
  and each parameter's full gradient is freed as soon as it is copied, so a rank keeps 4Ψ/N
  bytes of gradient plus the buckets in flight (:mod:`phalanx.sharding.grad_reduce_scatter`).

Hybrid sharding (``replicate_group``, :mod:`phalanx.sharding.hybrid`): the ranges are split
over ``process_group`` (one host's ranks) and each reduced bucket chunk is all-reduced over
``replicate_group`` (the ranks holding the same ranges on the other hosts) before it is stepped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from phalanx._check import check_group
from phalanx.data_parallel.sync_flag import sync_off
from phalanx.sharding import zero_pieces, zero_state
from phalanx.sharding.bucket_storage import broadcast_from_rank0, place
from phalanx.sharding.clip import clip_pieces_
from phalanx.sharding.grad_reduce_scatter import GradReducer
from phalanx.sharding.layout import ShardLayout, plan_shards
from phalanx.sharding.owned import (
    OwnedRange,
    attach_local_grads,
    owned_ranges,
    refresh,
    release_grads,
)
from phalanx.sharding.param_sync import ParamGatherer, StagingPool
from phalanx.sharding.pieces import PieceReader, ShardedState
from phalanx.sharding.zero_join import JoinableZero
from phalanx.sharding.zero_params import (
    check_elementwise,
    check_flags,
    check_options,
    check_params,
    check_replicate,
    check_same_dense_type,
    check_zero_args,
    sync_options,
)

__all__ = ["ZeroRedundancyOptimizer", "check_elementwise"]


class ZeroRedundancyOptimizer(torch.optim.Optimizer, JoinableZero):
    """Shard any element-wise ``torch.optim`` optimizer across the data-parallel group.

    Args:
        params: Parameters or parameter groups (dicts with ``params`` and per-group options),
            as for any optimizer; one dense dtype on one device. Parameters that do not require
            grad are sharded too (they are stepped once they get gradients).
        optimizer_class: e.g. ``torch.optim.AdamW``.
        process_group: The data-parallel group (default: the world).
        parameters_as_bucket_view: True makes the parameters views of one contiguous buffer
            per bucket (one copy per rank per bucket when gathering); False (torch's default)
            leaves each parameter's storage alone.
        overlap_with_ddp: torch's step inside DDP hooks; not supported (use ``stage=2``).
        stage: None: gradients are averaged before ``step()`` (by DDP; torch's contract).
            1 or 2: this optimizer averages them itself (no DDP) at ``step()`` or during
            backward; it then also broadcasts rank 0's parameters at construction, unless
            ``broadcast_params=False`` (a live job's replacement receives them after it joins).
        bucket_cap_mb: Bucket size for the reduce-scatter / all-gather pipeline.
        replicate_group: Hybrid sharding (``stage`` 1 or 2): the ranks that hold the same
            ranges as this one on other hosts. Each reduce-scattered chunk is all-reduced over
            it, so gradients average over ``process_group`` x ``replicate_group``; rank 0's
            parameters are broadcast over both at construction. None: plain ZeRO.
        **defaults: Passed to ``optimizer_class``.

    ``step(closure, **kwargs)``, ``zero_grad``, ``add_param_group``, ``consolidate_state_dict``
    / ``state_dict`` / ``load_state_dict`` and :class:`~torch.distributed.algorithms.join.Join`
    behave as torch's. A parameter whose ``grad`` is None (on every rank) is not stepped. Clip
    with :meth:`clip_grad_norm_` (the norm spans every rank's shard); with ``stage`` 1 or 2,
    accumulate with :meth:`no_sync`. The optimizer must update each element from that
    element's own gradient and state (SGD, Adam, AdamW, Adagrad, RMSprop, ...).
    """

    @check_zero_args
    def __init__(
        self,
        params: Any,
        optimizer_class: type[torch.optim.Optimizer],
        process_group: dist.ProcessGroup | None = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        *,
        stage: int | None = None,
        bucket_cap_mb: float = 25.0,
        broadcast_params: bool = True,
        replicate_group: dist.ProcessGroup | None = None,
        **defaults: Any,
    ) -> None:
        check_options(optimizer_class, stage, defaults)
        check_replicate(stage, replicate_group)
        check_flags(overlap_with_ddp)
        groups = check_params(params)
        check_same_dense_type(
            [p for g in groups for p in g["params"]] if isinstance(groups[0], dict) else groups
        )
        self._initialized = False
        torch.optim.Optimizer.__init__(self, groups, defaults)
        JoinableZero.__init__(self)
        self.stage, self.bucket_cap_mb = stage, bucket_cap_mb
        self.parameters_as_bucket_view = bool(parameters_as_bucket_view)
        self.process_group = process_group
        ready = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(process_group) if ready else 1
        self.rank = dist.get_rank(process_group) if ready else 0
        self.replicate_group = replicate_group
        self.replicas = dist.get_world_size(replicate_group) if replicate_group else 1
        self.replica = dist.get_rank(replicate_group) if replicate_group else 0
        """This rank's index in ``replicate_group``: only replica 0 writes checkpoint pieces."""
        self.params: list[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        self.layout: ShardLayout = self._plan()
        self.buffers: list[torch.Tensor] | None = [] if self.parameters_as_bucket_view else None
        self.owned: list[list[OwnedRange]] = []
        self._consolidated: dict[int, dict[str, Any]] | None = None
        self._notified = False
        self._reducer: GradReducer | None = None
        self._own_new_buckets(0, broadcast=broadcast_params)
        self._build_inner(optimizer_class, defaults)
        self._wire()
        self._initialized = True

    def _build_inner(self, optimizer_class: type[torch.optim.Optimizer], defaults: Any) -> None:
        """The inner optimizer over this rank's ranges (its state starts empty)."""
        inner = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": self._tensors_of(gi)}
            for gi, g in enumerate(self.param_groups)
        ]
        self.optim = optimizer_class(inner, **defaults)
        sync_options(self.optim.param_groups, self.param_groups)
        self.state = self.optim.state  # this rank's state, keyed by what it steps

    # ---- layout --------------------------------------------------------------------------------
    def _plan(self) -> ShardLayout:
        sizes = [[p.numel() for p in g["params"]] for g in self.param_groups]
        cap = int(self.bucket_cap_mb * 1024 * 1024)
        size = self.params[0].element_size()
        # Stage 2 packs in backward order (buckets fill as gradients arrive); flags let a
        # reduce-scatter say which parameters had a gradient on any rank.
        reverse, flags = self.stage == 2, self.stage is not None
        return plan_shards(sizes, self.world, size, cap, reverse=reverse, flags=flags)

    def _own_new_buckets(self, first: int, broadcast: bool = True) -> None:
        """Storage, ownership and (stages 1/2, with ``broadcast``) rank 0's values for buckets
        ``first`` onwards."""
        for b in range(first, len(self.layout.buckets)):
            bucket = self.layout.buckets[b]
            buf = place(self.params, bucket, self.buffers is not None)
            if self.buffers is not None and buf is not None:
                self.buffers.append(buf)
            if broadcast and self.stage is not None and self.world > 1:
                broadcast_from_rank0(self.params, bucket, buf, self.process_group)
            if broadcast and self.replicas > 1:  # then across hosts (hybrid sharding)
                broadcast_from_rank0(self.params, bucket, buf, self.replicate_group)
        self.owned += owned_ranges(
            self.params, self.layout, self.rank, step_params=self.stage is None, first_bucket=first
        )

    def _tensors_of(self, group: int) -> list[torch.Tensor]:
        return [
            r.tensor
            for mine in self.owned
            for r in mine
            if self.layout.buckets[r.bucket].group == group
        ]

    def _wire(self) -> None:
        """(Re)build the staging pool, the all-gather and (stages 1/2) the reduce-scatter."""
        p0 = self.params[0]
        pool = StagingPool(self.layout, p0.dtype, p0.device, self.process_group)
        self._gatherer = ParamGatherer(
            self.params, self.layout, self.buffers, pool, self.process_group, self.rank
        )
        sync = True
        if self._reducer is not None:
            sync = self._reducer.require_backward_grad_sync
            self._reducer.close()
        if self.stage is not None:
            self._reducer = GradReducer(
                self.params,
                self.layout,
                self.owned,
                pool,
                self.process_group,
                self.stage,
                self._notify,
                self.replicate_group,
            )
            self._reducer.require_backward_grad_sync = sync

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group: its parameters are sharded like the others (call it on every rank)."""
        if not self._initialized:  # torch.optim.Optimizer.__init__ adding the first groups
            super().add_param_group(param_group)
            return
        group = check_params([param_group])[0]
        check_same_dense_type(self.params + list(group["params"]))
        super().add_param_group(group)
        self.params.extend(self.param_groups[-1]["params"])
        old = len(self.layout.buckets)
        layout = self._plan()
        assert layout.buckets[:old] == self.layout.buckets, "earlier buckets must not move"
        self.layout = layout
        self._own_new_buckets(old)
        options = {k: v for k, v in self.param_groups[-1].items() if k != "params"}
        self.optim.add_param_group(
            {**options, "params": self._tensors_of(len(self.param_groups) - 1)}
        )
        sync_options(self.optim.param_groups, self.param_groups)
        self._wire()

    def regroup(
        self,
        process_group: dist.ProcessGroup | None = None,
        full_state: dict[str, Any] | None = None,
    ) -> None:
        """Shard over ``process_group`` (None: the default group) from now on, in place.

        For live recovery, which replaces the default group: re-plans the buckets for the new
        size and rank (parameters stay the same objects), rebuilds the inner optimizer and
        gradient hooks, and keeps its ranges of ``full_state`` (the whole ``torch.optim`` state,
        as :meth:`state_dict` after :meth:`consolidate_state_dict`; None: empty). The caller
        guarantees equal parameters and the same ``full_state`` on every rank, and no half-done
        step (unstepped gradients are dropped); a joining rank builds its optimizer with
        ``broadcast_params=False``. Collective over the new group.

        Raises:
            TypeError, ValueError: ``full_state`` is not such a dict, or of another model.
        """
        if not dist.is_initialized():
            raise RuntimeError("ZeroRedundancyOptimizer.regroup: init the new group first")
        if self.replicate_group is not None:
            raise ValueError(
                "ZeroRedundancyOptimizer.regroup: a hybrid-sharded optimizer "
                "(replicate_group=...) cannot be regrouped; live recovery supports plain ZeRO"
            )
        check_group("process_group", process_group, where="ZeroRedundancyOptimizer.regroup")
        zero_state.check_full_state(self, full_state)
        for p in self.params:  # a step in flight is dropped (its reduction is lost anyway)
            p.grad = None
        self.process_group = process_group
        self.world, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        self.layout = self._plan()
        self.buffers = [] if self.parameters_as_bucket_view else None
        self.owned = []
        self._own_new_buckets(0, broadcast=False)  # the caller made the replicas equal
        self._build_inner(type(self.optim), self.defaults)
        self._consolidated, self._notified = None, False
        self._wire()  # closes the old reducer: its hooks go
        if full_state is not None:
            zero_state.load_full_state_dict(self, full_state)

    # ---- the step ------------------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Step this rank's ranges (``closure`` and ``kwargs`` go to the inner optimizer's
        ``step``, as torch's do) and all-gather the updated parameters. Collective."""
        return self._step(closure, kwargs, notify=True)

    def _step(self, closure: Any, kwargs: dict[str, Any], *, notify: bool) -> Any:
        if notify:
            self._notify()
        self._notified = True  # a joined rank shadows the step without notifying
        if self._reducer is not None:
            self._reducer.refresh_hooks()
        sync_options(self.param_groups, self.optim.param_groups)
        refresh(self.owned, self.params)
        loss = self._inner_step(closure, kwargs)
        sync_options(self.optim.param_groups, self.param_groups)
        with torch.no_grad():
            self._gatherer.gather()
        if self._reducer is None:
            release_grads(self.owned, self.params)
        else:  # the next step reduces again, zero_grad or not (gradients then accumulate)
            self._reducer.reduced = False
        self._notified = False
        return loss

    def _inner_step(self, closure: Any, kwargs: dict[str, Any]) -> Any:
        if self._reducer is None:  # torch's contract: the gradients are averaged already
            attach_local_grads(self.owned, self.params)
            if closure is None:
                return self.optim.step(**kwargs)

            def closure_then_attach() -> Any:
                loss = closure()
                attach_local_grads(self.owned, self.params)
                return loss

            return self.optim.step(closure=closure_then_attach, **kwargs)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._reducer.ensure_reduced()
        out = self.optim.step(**kwargs)
        return loss if closure is not None else out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' gradients and this rank's reduced gradients."""
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
                continue
            if p.grad.grad_fn is not None:
                p.grad.detach_()
            else:
                p.grad.requires_grad_(False)
            p.grad.zero_()
        if self._reducer is not None:
            self._reducer.zero_grad()
        else:
            release_grads(self.owned, self.params)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the averaged gradients by their norm over all ranks' shards; return the norm.

        Call after backward and before :meth:`step`. Equal to ``torch.nn.utils.clip_grad_norm_``
        on the full averaged gradient.
        """
        if not max_norm > 0:
            raise ValueError(f"clip_grad_norm_: max_norm must be positive, got {max_norm!r}")
        grads = self.owned_grads()
        device = self.params[0].device
        return clip_pieces_(grads, max_norm, norm_type, self.process_group, device, self.world)

    def owned_grads(self) -> list[torch.Tensor]:
        """This rank's ranges' averaged gradients, as the inner optimizer (``self.optim``) will
        step them: stages 1/2 reduce now (collective) unless a synchronised backward already
        did; ``stage=None`` views the parameters' own gradients. For clipping and fp16
        unscaling (``step()`` then does not reduce again)."""
        if self._reducer is None:
            refresh(self.owned, self.params)
            attach_local_grads(self.owned, self.params)
        else:
            self._reducer.ensure_reduced()
        return [r.tensor.grad for mine in self.owned for r in mine if r.tensor.grad is not None]

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Stages 1/2: backward passes inside accumulate local gradients without communicating."""
        with sync_off(self):
            yield

    @property
    def require_backward_grad_sync(self) -> bool:
        """False makes the coming backward accumulate locally (the job API's switch)."""
        return self._reducer.require_backward_grad_sync if self._reducer is not None else True

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        if self._reducer is not None:
            self._reducer.require_backward_grad_sync = bool(value)

    @property
    def _all_params(self) -> list[torch.Tensor]:
        """Every parameter in order: torch's name for it, kept for code written against torch."""
        return self.params

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
        """Bytes of reduced gradient shards this rank holds (stage 2 keeps no full gradients)."""
        return self._reducer.grad_bytes() if self._reducer is not None else 0

    # ---- state ---------------------------------------------------------------------------------
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full optimizer state on rank ``to`` of the group. Collective."""
        self._consolidated = zero_state.consolidate(self, to)

    def state_dict(self) -> dict[str, Any]:
        """The state gathered by the last :meth:`consolidate_state_dict` to this rank, in
        ``torch.optim`` format (loads into a plain optimizer over the same parameters)."""
        if self._consolidated is None:
            raise RuntimeError(
                f"ZeroRedundancyOptimizer.state_dict(): the optimizer state has not been "
                f"consolidated on rank {self.rank}; call consolidate_state_dict(to={self.rank}) "
                f"on every rank first"
            )
        return {"state": self._consolidated, "param_groups": zero_state.groups_meta(self)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``torch.optim``-format state dict; each rank keeps its shard of it."""
        zero_state.load_full_state_dict(self, state_dict)

    def sharded_state(self) -> ShardedState:
        """This rank's state as world-size-independent pieces (``phalanx.checkpoint``)."""
        return zero_pieces.sharded_state(self, writes=self.replica == 0)

    def load_sharded_state(self, meta: dict[str, Any], reader: PieceReader) -> None:
        """Restore from pieces saved at any world size."""
        zero_pieces.load_sharded_state(self, meta, reader)
