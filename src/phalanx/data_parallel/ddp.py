"""``phalanx.DistributedDataParallel``: a drop-in for torch's, built on ``reducer.py``.

Each process holds a replica; at wrap time the ranks check that their models agree and take
rank 0's parameters and buffers; during backward the gradients are averaged bucket by bucket,
overlapped with the rest of backward (seeds 001, 002, 004).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.comm import collectives as c
from phalanx.comm.objects import all_gather_object
from phalanx.data_parallel.reducer import Hook, Reducer

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(nn.Module):
    """Data parallel training: replicas in N processes, gradients averaged by all-reduce.

    Same constructor as ``torch.nn.parallel.DistributedDataParallel``. Differences: an unused
    parameter without ``find_unused_parameters`` raises an error that names it, at the end of
    the backward that missed it; mismatched models across ranks are reported at wrap time with
    the rank, parameter and both shapes; works on CPU (gloo) and GPU (NCCL) alike.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: list[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = 25,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(
                "DistributedDataParallel needs a process group: call "
                "phalanx.init_process_group() first (launch with `phalanx run`)"
            )
        cap_mb = 25 if bucket_cap_mb is None else bucket_cap_mb
        if cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError(
                f"device_ids={device_ids}: one device per process; launch one process per GPU"
            )
        self.module = module
        self.device = _device_of(device_ids)
        self.output_device = output_device
        self.dim = dim
        self.broadcast_buffers = broadcast_buffers
        self.process_group = process_group
        self.find_unused_parameters = find_unused_parameters or static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.require_backward_grad_sync = True
        self._join_active = False
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("DistributedDataParallel: the module has no parameter requiring grad")
        _check_same_model(module, process_group)
        self._sync_module_states()
        self.reducer = Reducer(
            named,
            process_group,
            int(cap_mb * 1024 * 1024),
            self.find_unused_parameters,
            gradient_as_bucket_view,
        )

    # ---- construction helpers ----------------------------------------------------------------
    def _sync_module_states(self) -> None:
        tensors = [p.detach() for p in self.module.parameters()]
        tensors += [b for b in self.module.buffers()]
        _broadcast_coalesced(tensors, self._root(), self.process_group)

    def _root(self) -> int:
        return dist.get_global_rank(self.process_group, 0) if self.process_group else 0

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; syncs buffers from rank 0 first when ``broadcast_buffers``."""
        if self._join_active:
            _join_flag(1, self.process_group)
        # As torch: buffers follow rank 0 before every forward that will sync gradients.
        grad_sync = self.require_backward_grad_sync and torch.is_grad_enabled()
        self.reducer.enabled = grad_sync
        if grad_sync:
            self._sync_buffers()
        if self.device is not None:
            inputs, kwargs = _move(inputs, self.device), _move(kwargs, self.device)
        return self.module(*inputs, **kwargs)

    def _sync_buffers(self) -> None:
        if not self.broadcast_buffers:
            return
        buffers = list(self.module.buffers())
        if buffers:
            _broadcast_coalesced(buffers, self._root(), self.process_group)

    # ---- public API ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) in backward passes run inside."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: Any, hook: Hook) -> None:
        """Replace the bucket all-reduce by ``hook(state, bucket) -> Future[Tensor]``.

        The contract is torch's: the future's value is the bucket's averaged flat buffer. Only
        one hook may be registered, before the first backward.
        """
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        if self.reducer.hook is not None:
            raise RuntimeError("register_comm_hook() may be called only once")
        self.reducer.hook, self.reducer.hook_state = hook, state

    @contextlib.contextmanager
    def join(self, enable: bool = True) -> Iterator[None]:
        """Train on uneven inputs: a rank that runs out of batches shadows the others.

        Inside the block each forward first agrees who is still training; on leaving it, a rank
        keeps taking part in the others' gradient all-reduces (with zero gradients) until every
        rank has left, so nobody hangs at the end of an epoch. As with torch's Join, gradients
        are averaged over the full world size.
        """
        if not enable:
            yield
            return
        self._join_active = True
        try:
            yield
        finally:
            try:
                last = True
                while _join_flag(0, self.process_group) > 0:
                    last = False
                    self._sync_buffers()
                    self.reducer.shadow_iteration()
                self._sync_final_model(last)
            finally:
                self._join_active = False

    def _sync_final_model(self, last_joiner: bool) -> None:
        # Joined ranks skipped the optimizer steps of the others' extra batches: take the model
        # of a rank that trained to the end (the highest-ranked last joiner), as torch does.
        me = dist.get_rank()
        src = torch.tensor([me if last_joiner else -1], dtype=torch.int64)
        c.all_reduce(src, dist.ReduceOp.MAX, self.process_group)
        tensors = [p.detach() for p in self.module.parameters()]
        _broadcast_coalesced([*tensors, *self.module.buffers()], int(src), self.process_group)


def _device_of(device_ids: list[int | torch.device] | None) -> torch.device | None:
    if not device_ids:
        return None
    d = device_ids[0]
    return torch.device("cuda", d) if isinstance(d, int) else torch.device(d)


def _move(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple):
        return tuple(_move(o, device) for o in obj)
    if isinstance(obj, list):
        return [_move(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _move(v, device) for k, v in obj.items()}
    return obj


def _join_flag(active: int, group: dist.ProcessGroup | None) -> int:
    flag = torch.tensor([active], dtype=torch.int32)
    c.all_reduce(flag, dist.ReduceOp.SUM, group)
    return int(flag.item())


def _broadcast_coalesced(
    tensors: list[torch.Tensor], src: int, group: dist.ProcessGroup | None
) -> None:
    """Broadcast many tensors as one flat tensor per (device, dtype)."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    for group_tensors in by_kind.values():
        flat = torch.cat([t.reshape(-1) for t in group_tensors])
        c.broadcast(flat, src, group)
        offset = 0
        with torch.no_grad():
            for t in group_tensors:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def _check_same_model(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Every rank must hold the same parameter names, shapes and dtypes; name what differs."""
    mine = [[n, list(p.shape), str(p.dtype)] for n, p in module.named_parameters()]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    all_gather_object(everyone, mine, group)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone):
        if theirs == reference:
            continue
        raise ValueError(_model_difference(reference, theirs, rank, dist.get_rank()))


def _model_difference(ref: list[Any], other: list[Any], rank: int, me: int) -> str:
    head = f"[rank {me}] DistributedDataParallel: the model on rank {rank} differs from rank 0's"
    ref_by = {n: (s, d) for n, s, d in ref}
    other_by = {n: (s, d) for n, s, d in other}
    for name, (shape, dtype) in ref_by.items():
        if name not in other_by:
            return f"{head}: parameter {name!r} (shape {shape}) is missing on rank {rank}"
        oshape, odtype = other_by[name]
        if oshape != shape or odtype != dtype:
            return (
                f"{head}: parameter {name!r} has shape {shape} {dtype} on rank 0 but "
                f"{oshape} {odtype} on rank {rank}"
            )
    extra = [n for n in other_by if n not in ref_by]
    if extra:
        return f"{head}: rank {rank} has extra parameter(s) {extra}"
    return f"{head}: the parameters are registered in a different order"
