"""The ZeRO-3 step: when each unit gathers, frees, prefetches and reduce-scatters.

Forward: the root unit gathers at the start and stays gathered until its gradient is done
(it would be re-gathered immediately in backward; FSDP2 does the same). Each other unit
gathers in its forward-pre-hook, starts the all-gather of the unit expected next (the order
recorded in the previous step; registration order in the first), and frees after its forward.

Backward: a hook on a unit's outputs fires just before its backward and re-gathers it, starting
the all-gather of the unit that ran before it in forward. When the unit's flat gradient is
complete (post-accumulate-grad hook on its leaf) it is reduce-scattered asynchronously and the
full parameters are freed; a reduce-scatter is waited for when the next one is issued, so at
most one full gradient is in flight. A callback queued on the autograd engine finishes the
step: units that received no gradient reduce-scatter zeros (every rank issues the same
collectives in the same order), remaining work is waited for, everything is freed.

A unit recomputed in backward (activation checkpointing inside it) gathers again in its
forward-pre-hook and stays gathered until its gradient is done, as in backward without it.

Every rank must run the same units in the same order (as with torch FSDP): collectives are
issued from these hooks, so a rank-dependent control flow would pair mismatched collectives.

Why not the bucket engine of DDP and ZeRO-1/2 (:mod:`phalanx.data_parallel.bucket_engine`):
that engine launches buckets in an order fixed before backward. A unit's reduce-scatter goes out
when backward completes its gradient, in an order known only from this step's forward; holding a
unit back for a predecessor would keep its full gradient and parameters alive (the memory
ZeRO-3 frees), and a unit without a gradient this step would hold back every later one until
backward ends. A unit is one flat leaf whose hook fires once, so there is nothing to count, and
the one wait site is :meth:`Runtime._drain` (at most one reduce-scatter in flight).

Hybrid sharding (``replicate_group``): each reduced shard is also all-reduced over the ranks
that hold it on the other hosts. That all-reduce starts when the next unit's reduce-scatter is
issued and is waited for one unit later (:meth:`Runtime._advance`), so at most one
reduce-scatter inside the host and one all-reduce between hosts are in flight.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from phalanx.sharding.zero3.unit import FlatUnit, PendingReduce

__all__ = ["Runtime"]


class Runtime:
    """Per-step state shared by the hooks of one ``FullyShardedDataParallel``."""

    def __init__(
        self,
        root: FlatUnit | None,
        units: list[FlatUnit],
        prefetch: bool,
        param_dtype: torch.dtype | None,
    ) -> None:
        self.root, self.units, self.prefetch, self.param_dtype = root, units, prefetch, param_dtype
        self.order: list[FlatUnit] = []
        self._position: dict[int, int] = {}
        # Prefetch order: the previous step's forward order (registration order at first).
        self._first: FlatUnit | None = units[0] if units else None
        self._next: dict[int, FlatUnit] = dict(zip(map(id, units), units[1:]))
        self._pending: list[PendingReduce] = []
        self._callback_queued = False
        self._bwd_started: set[int] = set()
        self.require_backward_grad_sync = True
        """Whether this step's backward reduce-scatters (set by the forward before it)."""
        self.in_step = self._armed = False
        self.handles: list[Any] = []
        for unit in units:
            self.handles.append(
                unit.module.register_forward_pre_hook(
                    self._hook_pre_forward(unit), with_kwargs=True
                )
            )
            self.handles.append(unit.module.register_forward_hook(self._hook_post_forward(unit)))

    # ---- root forward -----------------------------------------------------------------------
    def begin_forward(self, sync: bool) -> None:
        """Start a step, or continue one whose forward has not been followed by backward yet.

        Several forwards before one backward (two inputs, one loss) share the step: the root
        stays gathered and each unit keeps its autograd leaf, so their gradients meet there.
        A step whose backward started but never finished (it raised) is discarded.
        """
        if self.in_step and self._callback_queued:
            self._finish(abandoned=True)
        self.require_backward_grad_sync = sync  # as DDP: the forward before the backward decides
        if not self.in_step:
            self.in_step, self._armed = True, False
            self.order, self._position = [], {}
            self._bwd_started.clear()
            for unit in self.all_units():
                unit.drop_views()
                unit.reduced = False
        if self.root is not None:
            self._activate(self.root)
        first = self._first
        if self.prefetch and first is not None and id(first) not in self._position:
            _prefetch(first)

    def end_forward(self, output: Any) -> Any:
        """Record the order for next step's prefetch; arm the backward hooks (or finish)."""
        if self.order:
            self._first = self.order[0]
            self._next = dict(zip(map(id, self.order), self.order[1:]))
        tensors = _grad_tensors(output)
        if tensors:
            self._armed = True
            self._register_pre_backward(tensors, None)
        elif not self._armed:  # no_grad / eval: nothing will come back through backward
            self._finish(abandoned=False)
        return output

    # ---- unit hooks -------------------------------------------------------------------------
    def _hook_pre_forward(self, unit: FlatUnit) -> Any:
        def hook(module: Any, args: Any, kwargs: Any) -> Any:
            if id(unit) not in self._position:
                self._position[id(unit)] = len(self.order)
                self.order.append(unit)
            self._activate(unit)
            nxt = self._next.get(id(unit))
            if self.prefetch and nxt is not None and id(nxt) not in self._position:
                _prefetch(nxt)
            if self.param_dtype is not None:
                return self.cast_inputs(args, kwargs)
            return None

        return hook

    def _hook_post_forward(self, unit: FlatUnit) -> Any:
        def hook(module: Any, args: Any, output: Any) -> Any:
            if torch._C._current_graph_task_id() != -1:
                return None  # recomputed in backward (activation checkpointing): still needed
            unit.free()
            tensors = _grad_tensors(output)
            if tensors:
                self._register_pre_backward(tensors, unit)
            return None

        return hook

    def cast_inputs(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """Floating-point tensors in ``(args, kwargs)`` cast to ``param_dtype``."""
        dtype = self.param_dtype

        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(dtype) if t.is_floating_point() and dtype is not None else t

        return tree_map_only(torch.Tensor, cast, (args, kwargs))

    def _activate(self, unit: FlatUnit) -> None:
        unit.ensure_gathered()
        if not unit.has_views:
            train = torch.is_grad_enabled() and unit.requires_grad
            unit.make_views(self._on_grad if train else None)

    # ---- backward ---------------------------------------------------------------------------
    def _register_pre_backward(self, tensors: list[torch.Tensor], unit: FlatUnit | None) -> None:
        fired = [False]

        def hook(grad: torch.Tensor) -> None:
            if not fired[0]:
                fired[0] = True
                self._pre_backward(unit)

        for t in tensors:
            t.register_hook(hook)

    def _queue_end_of_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _pre_backward(self, unit: FlatUnit | None) -> None:
        self._queue_end_of_backward()
        if unit is None:  # the root's outputs: the last unit of forward runs backward first
            if self.prefetch and self.order:
                _prefetch(self.order[-1])
            return
        if id(unit) in self._bwd_started:
            return
        self._bwd_started.add(id(unit))
        unit.ensure_gathered()
        i = self._position.get(id(unit), 0)
        if self.prefetch and i > 0 and not self.order[i - 1].reduced:
            _prefetch(self.order[i - 1])

    def _on_grad(self, unit: FlatUnit, leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        assert grad is not None
        self._queue_end_of_backward()
        pending = unit.reduce_grad(grad, self.require_backward_grad_sync)
        unit.free()
        if pending is not None:
            self._advance()  # the previous reduce-scatter overlapped this unit's backward
            self._pending.append(pending)

    def _advance(self) -> None:
        """Make room for a new reduce-scatter: finish the ones in flight, except that under
        hybrid sharding the newest only *crosses* (its all-reduce between hosts starts and
        overlaps the next unit's backward; :class:`PendingReduce`)."""
        newest = self._pending[-1:]
        if newest and newest[0].crosses:
            newest[0].cross()
            self._pending = self._pending[:-1]
            self._drain()
            self._pending = newest
        else:
            self._drain()

    def _drain(self) -> None:
        for pending in self._pending:
            pending.finish()
        self._pending.clear()

    def _end_backward(self) -> None:
        self._finish(abandoned=False)

    def _finish(self, abandoned: bool) -> None:
        """End the step: zero reduce-scatters for units without gradient, wait, free all."""
        if self.require_backward_grad_sync and self._callback_queued and not abandoned:
            for unit in self.all_units():
                if unit.requires_grad and not unit.reduced:
                    pending = unit.reduce_grad(unit.zero_grad_for_reduce(), True)
                    assert pending is not None
                    self._pending.append(pending)
        self._drain()
        for unit in self.all_units():
            unit.free()
            unit.drop_views()
        self._callback_queued = False
        self.in_step = False

    def all_units(self) -> list[FlatUnit]:
        """Every unit, the root last."""
        return [*self.units, *([self.root] if self.root is not None else [])]


def _prefetch(unit: FlatUnit) -> None:
    if unit.state == "free":
        unit.gather(async_op=True)


def _grad_tensors(output: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(output)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
