"""``FullyShardedDataParallel``: ZeRO stage 3 (Rajbhandari et al. 2019, §5.3, P_os+g+p).

Each rank keeps 1/N of every parameter, of its gradient and (through any ``torch.optim``
optimizer built over :meth:`parameters`) of the optimizer state: 16Ψ/N bytes for fp32 Adam
instead of 16Ψ. Parameters are all-gathered just in time, unit by unit, in forward and again in
backward, and gradients are reduce-scattered: 3Ψ elements per step, 1.5x DDP's 2Ψ.

Hybrid sharding (``replicate_group``, :mod:`phalanx.sharding.hybrid`): the shards are split
over ``process_group`` (one host's ranks) and replicated over ``replicate_group`` (the ranks
that hold the same shard on the other hosts), each reduced gradient shard all-reduced there.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from phalanx._check import check_bool, check_group, check_instance, check_module, fail
from phalanx.comm import collectives as c
from phalanx.data_parallel.sync_flag import sync_off
from phalanx.sharding.clip import clip_pieces_
from phalanx.sharding.pieces import HeldPieces, PieceReader, ShardedState
from phalanx.sharding.zero3 import optim_state as ostate
from phalanx.sharding.zero3 import state_dict as st
from phalanx.sharding.zero3.plan import WrapPolicy, assign_params, normalize_wrap, select_units
from phalanx.sharding.zero3.runtime import Runtime
from phalanx.sharding.zero3.unit import FlatUnit, GroupInfo

__all__ = ["FullyShardedDataParallel"]

FLAT_NAME = "_flat_param"
WHERE = "FullyShardedDataParallel"


class FullyShardedDataParallel(nn.Module):
    """Shard a module's parameters, gradients and optimizer state across a process group.

    Args:
        module: The model (its parameters are replaced by views of gathered buffers).
        process_group: The data-parallel group (default: the world); with
            ``replicate_group``, the group that splits the shards (one host's ranks).
        replicate_group: Hybrid sharding: the ranks holding the same shard as this one on other
            hosts (each of them in its own ``process_group`` of the same size). Gradient shards
            are all-reduced over it after each reduce-scatter, so they average over
            ``process_group`` x ``replicate_group``; rank 0's parameters are broadcast over both
            at construction. None (default): plain ZeRO-3.
        wrap: Which submodules become units of their own (gathered one at a time): a module
            class, a tuple of classes or a predicate. The outermost selected modules count
            (no nesting); every other parameter, and any parameter shared across units (tied
            weights), belongs to the root unit, which stays gathered for the whole step.
        param_dtype: Mixed precision: gather and compute in this dtype (the shards, the
            gradients given to the optimizer and its state stay in the original dtype).
        reduce_dtype: dtype of the gradient reduce-scatter (default: ``param_dtype``).
        prefetch: Start the next unit's all-gather while the current one computes.
        sync_module_states: Broadcast rank 0's parameters and buffers before sharding, after
            checking that every rank built the same units. False communicates nothing: the
            caller makes the shards equal (live recovery's replacement, which receives them).

    Build the optimizer after wrapping, over ``fsdp.parameters()``: one flat 1-D shard per
    unit, whose ``.grad`` after backward is this rank's shard of the averaged gradient.

    Limitations: move the model to its device (and dtype) before wrapping; one backward per
    step (several forwards before it are fine); every rank runs the same units in the same
    order; a unit's outputs must be tensors or pytree containers of them (the backward
    re-gather hooks on them); no activation checkpointing inside units; a unit's parameters
    must be all trainable or all frozen; ``get_extra_state`` is not saved.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        replicate_group: dist.ProcessGroup | None = None,
        wrap: WrapPolicy = None,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        prefetch: bool = True,
        sync_module_states: bool = True,
    ) -> None:
        super().__init__()
        rank = dist.get_rank() if dist.is_initialized() else 0
        _check_args(
            module, process_group, param_dtype, reduce_dtype, prefetch, sync_module_states, rank
        )
        check_group("replicate_group", replicate_group, where=f"[rank {rank}] {WHERE}")
        info = _group_info(process_group, replicate_group)
        keys = st.StateLayout.tensor_keys(module)
        try:
            policy = normalize_wrap(wrap)
        except TypeError as exc:
            raise TypeError(f"[rank {rank}] FullyShardedDataParallel: {exc}") from None
        chosen = select_units(module, policy)
        per_unit, root_refs = assign_params(module, [name for name, _ in chosen])
        if sync_module_states:
            _check_same_structure(module, per_unit, root_refs, info)
            _broadcast_buffers(module, info)
        build = lambda name, mod, refs: FlatUnit(  # noqa: E731
            name, mod, refs, info, param_dtype, reduce_dtype, sync_module_states
        )
        self._units = [build(n, m, refs) for (n, m), refs in zip(chosen, per_unit) if refs]
        self._root = build("", module, root_refs) if root_refs else None
        for unit in self.units:
            unit.module.register_parameter(FLAT_NAME, unit.flat_param)
        self.module = module
        self.process_group = process_group
        self.replicate_group = replicate_group
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.require_backward_grad_sync = True
        self._info = info
        self._layout = st.StateLayout.build(keys, module, self.units)
        self._runtime = Runtime(self._root, self._units, prefetch, param_dtype)

    @property
    def units(self) -> list[FlatUnit]:
        """Every unit, the root unit (if it holds parameters) last."""
        return [*self._units, *([self._root] if self._root is not None else [])]

    # ---- the step ---------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module, gathering each unit's parameters just in time."""
        rt = self._runtime
        rt.begin_forward(self.require_backward_grad_sync)
        if self.param_dtype is not None:
            args, kwargs = rt.cast_inputs(args, kwargs)
        return rt.end_forward(self.module(*args, **kwargs))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate unsharded gradients locally, without communication;
        the next synchronised backward reduce-scatters the accumulated sum."""
        with sync_off(self):
            yield

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradient shards by the global norm over all ranks; return that norm.

        As ``torch.nn.utils.clip_grad_norm_`` on the unsharded model: each rank reduces its
        shards' sum of |g|^p (max |g| for the inf-norm) and all-reduces it.
        """
        grads = [u.flat_param.grad for u in self.units if u.flat_param.grad is not None]
        info, device = self._info, self.units[0].device
        return clip_pieces_(grads, max_norm, norm_type, info.group, device, info.world)

    # ---- state ------------------------------------------------------------------------------
    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """Full parameters and buffers under the original module's keys, original dtype.

        A collective (every rank must call it); with ``rank0_only`` other ranks get ``{}``.
        """
        return st.full_state_dict(self._layout, self.units, self._info, rank0_only)

    def load_full_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Take this rank's shard of every parameter (and every buffer) from full tensors."""
        st.load_full_state_dict(self._layout, self.units, state, self._info.rank)

    def state_dict(  # type: ignore[override]
        self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """``full_state_dict(rank0_only=False)``: the plain model's keys on every rank."""
        out = self.full_state_dict(rank0_only=False)
        if destination is None and not prefix:
            return out
        dest: dict[str, Any] = {} if destination is None else destination
        dest.update((prefix + k, v) for k, v in out.items())
        return dest

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> _IncompatibleKeys:
        """Load a plain (unsharded) state dict, as :meth:`load_full_state_dict`."""
        missing = st.missing_keys(self._layout, state_dict)
        known = set(self._layout.keys)
        unexpected = [k for k in state_dict if k not in known]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"[rank {self._info.rank}] Error(s) in loading state_dict for "
                f"FullyShardedDataParallel: missing keys {missing}, unexpected keys {unexpected}"
            )
        if missing:
            raise RuntimeError(
                f"[rank {self._info.rank}] load_state_dict(strict=False): partial loads are not "
                f"supported by FullyShardedDataParallel; missing keys {missing}"
            )
        self.load_full_state_dict({k: v for k, v in state_dict.items() if k in known})
        return _IncompatibleKeys(missing, unexpected)

    def full_optim_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The whole state of ``optimizer`` (built over :meth:`parameters`) on every rank, in
        ``torch.optim`` format, numbered by original parameter: each unit's in order, the root
        unit last. A collective."""
        return ostate.full_optim_state_dict(optimizer, self.units)

    def load_full_optim_state_dict(
        self, optimizer: torch.optim.Optimizer, optim_state_dict: dict[str, Any]
    ) -> None:
        """Keep this rank's shards of a :meth:`full_optim_state_dict` (from any world size)."""
        ostate.load_full_optim_state_dict(optimizer, self.units, optim_state_dict)

    def regroup(
        self,
        process_group: dist.ProcessGroup | None = None,
        full_state: Mapping[str, torch.Tensor] | None = None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        optim_state: dict[str, Any] | None = None,
    ) -> None:
        """Shard over ``process_group`` from now on (None: the current default group), in place.

        For live recovery, which replaces the default group when ranks are lost or join. Each
        unit's ``flat_param`` stays the same ``Parameter`` object (so an optimizer built over
        :meth:`parameters` keeps stepping it) and its data becomes this rank's shard, at the
        new size, of ``full_state`` (the model's full state dict, as :meth:`state_dict`
        gives; required: a rank holds only its own shard). Gathered buffers, gradients and the
        forward hooks are rebuilt. With ``optimizer``, its state is replaced, in place, by its
        shards of ``optim_state`` (:meth:`full_optim_state_dict`'s format; None: its state
        starts empty). Local: nothing is communicated.

        The caller guarantees that every rank of the new group passes the same states and that
        no step is half done (gradients not yet stepped are dropped). A joining rank wraps
        its model first (before joining, when no default group exists, the constructor
        communicates nothing) and calls this with the others.

        Raises:
            TypeError, ValueError: ``full_state`` or ``optim_state`` is not such a dict or is
                of another model (a key missing, a shape differing), before anything changes.
        """
        where = "FullyShardedDataParallel.regroup"
        if self.replicate_group is not None:
            raise ValueError(
                f"{where}: a hybrid-sharded model (replicate_group=...) cannot be regrouped; "
                f"live recovery supports plain ZeRO-3"
            )
        if not dist.is_initialized():
            raise RuntimeError(f"{where}: no default process group; init the new group first")
        check_group("process_group", process_group, where=where)
        if full_state is None:
            raise ValueError(
                f"{where}: full_state is required (the model's full state dict): this rank "
                f"holds only its own shard of the parameters"
            )
        st.check_full_state(self._layout, full_state, where)
        if optimizer is not None and optim_state is not None:
            ostate.check_full_optim_state(optimizer, self.units, optim_state, where)
        for handle in self._runtime.handles:
            handle.remove()
        self.process_group, self._info = process_group, _group_info(process_group)
        for unit in self.units:
            unit.reshard(self._info)
        st.load_full_state_dict(self._layout, self.units, full_state, self._info.rank)
        self._runtime = Runtime(self._root, self._units, self._runtime.prefetch, self.param_dtype)
        if optimizer is not None and optim_state is not None:
            self.load_full_optim_state_dict(optimizer, optim_state)
        elif optimizer is not None:  # shaped like the old shards: of no use any more
            for unit in self.units:
                optimizer.state.pop(unit.flat_param, None)

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each parameter's state-dict key and full (unsharded) shape (tied aliases included)."""
        return {key: entry.shape for key, (_, entry) in self._layout.params.items()}

    def sharded_state(self) -> ShardedState:
        """This rank's pieces of every parameter, keyed by the original state-dict keys (none
        on a hybrid replica other than the first: its shards equal the first's)."""
        return st.sharded_state(self._layout, self.units, self._info)

    @property
    def replica_index(self) -> int:
        """This rank's index in ``replicate_group`` (0 without one): only replica 0 writes
        checkpoint pieces, which every replica's shards equal."""
        return self._info.replica

    def load_sharded_state(self, meta: dict[str, Any], reader: PieceReader) -> None:
        """Fill this rank's shards from pieces saved at any world size."""
        st.load_sharded_state(self._layout, self.units, reader, self._info.rank)

    def shard_layout(self) -> HeldPieces:
        """Each flat shard with the pieces of original parameters it holds (to cut
        shard-shaped optimizer state)."""
        return [(u.flat_param, list(u.pieces)) for u in self.units]

    # ---- introspection ----------------------------------------------------------------------
    def param_bytes(self) -> int:
        """Bytes of parameter storage this rank holds now: its shards plus any gathered units."""
        return sum(
            u.flat_param.numel() * u.flat_param.element_size() + u.gathered_bytes()
            for u in self.units
        )

    def grad_bytes(self) -> int:
        """Bytes of gradient this rank holds: shard gradients plus ``no_sync`` accumulators."""
        total = 0
        for u in self.units:
            g = u.flat_param.grad
            total += (0 if g is None else g.numel() * g.element_size()) + u.accumulated_bytes()
        return total


def _group_info(
    group: dist.ProcessGroup | None, replicate: dist.ProcessGroup | None = None
) -> GroupInfo:
    src = dist.get_global_rank(group, 0) if group is not None else 0
    info = GroupInfo(group, dist.get_rank(group), dist.get_world_size(group), src)
    if replicate is None:
        return info
    return dataclasses.replace(
        info,
        replicate=replicate,
        replicas=dist.get_world_size(replicate),
        replica=dist.get_rank(replicate),
        replica_src=dist.get_global_rank(replicate, 0),
    )


def _broadcast_buffers(module: nn.Module, info: GroupInfo) -> None:
    """Rank 0's buffers on every rank: inside the shard group, then across replicas."""
    for buf in module.buffers():
        if info.world > 1:
            c.broadcast(buf, info.src, info.group)
        if info.replicas > 1:
            c.broadcast(buf, info.replica_src, info.replicate)


def _check_args(
    module: Any,
    group: Any,
    param_dtype: Any,
    reduce_dtype: Any,
    prefetch: Any,
    sync_module_states: Any,
    rank: int,
) -> None:
    who = f"[rank {rank}] FullyShardedDataParallel"
    if not dist.is_initialized():
        raise RuntimeError(
            f"{who} needs a process group: call phalanx.init_process_group() first "
            f"(launch with `phalanx run`)"
        )
    check_module("module", module, where=who)
    if isinstance(module, FullyShardedDataParallel) or any(
        FLAT_NAME in m._parameters for m in module.modules()
    ):
        raise ValueError(f"{who}: module is already wrapped; wrap the plain model once")
    check_group("process_group", group, where=who)
    for name, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if dtype is not None:
            check_instance(name, dtype, torch.dtype, "a torch.dtype or None", where=who)
            if not dtype.is_floating_point:
                raise fail(name, dtype, "a floating-point dtype", where=who)
    check_bool("prefetch", prefetch, where=who)
    check_bool("sync_module_states", sync_module_states, where=who)
    if not any(True for _ in module.parameters()):
        raise ValueError(f"{who}: module {type(module).__name__} has no parameters")


def _check_same_structure(
    module: nn.Module, per_unit: list[Any], root: list[Any], info: GroupInfo
) -> None:
    """Every rank must build the same units (else their collectives would not pair up):
    compared inside the shard group, and across replicas under hybrid sharding."""
    sizes = [sum(r.param.numel() for r in refs) for refs in [*per_unit, root]]
    sig = [len(sizes), sum(sizes), sum((i + 1) * n for i, n in enumerate(sizes))]
    device = next(module.parameters()).device
    mine = torch.tensor(sig, dtype=torch.int64, device=device)
    for group, size, what in (
        (info.group, info.world, "rank"),
        (info.replicate, info.replicas, "replica"),
    ):
        if size == 1:
            continue
        every = torch.empty(3 * size, dtype=torch.int64, device=device)
        c.all_gather_into_tensor(every, mine, group=group)
        rows = every.view(size, 3).tolist()
        if any(row != rows[0] for row in rows):
            raise ValueError(
                f"[rank {info.rank}] FullyShardedDataParallel: ranks built different units "
                f"([units, params, checksum] by {what}: {rows}); wrap the same model with the "
                f"same wrap policy on every rank"
            )
