"""``phalanx.DistributedDataParallel``: a drop-in for torch's, built on ``reducer.py``.

Each process holds a replica; at wrap time the ranks check that their models agree and take
rank 0's parameters and buffers; during backward the gradients are averaged bucket by bucket,
overlapped with the rest of backward (seeds 001, 002, 004). The constructor, attributes and
behaviour follow torch 2.13's class, which is checked by running torch's own DDP tests against
this one (``tests/compat``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from phalanx._eager import eager
from phalanx.comm import collectives as c
from phalanx.data_parallel import ddp_options as opts
from phalanx.data_parallel.ddp_join import DDPJoinHook
from phalanx.data_parallel.delayed import DelayedAllReduce
from phalanx.data_parallel.grad_access import GradSite, current_dist_autograd_context
from phalanx.data_parallel.grad_bucket import check_comm_hook
from phalanx.data_parallel.mixed_precision import ParamCaster, cast_inputs
from phalanx.data_parallel.module_state import broadcast_coalesced, check_same_model, common_rank
from phalanx.data_parallel.reducer import Hook, Reducer, ReducerOptions
from phalanx.data_parallel.scatter_gather import gather, map_tensors, scatter
from phalanx.data_parallel.sync_flag import sync_off

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(nn.Module, Joinable):
    """Data parallel training: replicas in N processes, gradients averaged by all-reduce.

    Same constructor, attributes and methods as ``torch.nn.parallel.DistributedDataParallel``
    (torch 2.13), with the same meaning; it passes torch's own DDP tests that run on CPU, but
    for those that read torch-internal attributes (``tests/compat/ddp_internal_only.txt``).
    Differences: an unused parameter without ``find_unused_parameters`` raises an error that
    names it, at the end of the backward that missed it; mismatched models across ranks are
    reported at wrap time with the rank, parameter and both shapes; works on CPU (gloo) and GPU
    (NCCL) alike; ``delay_all_reduce_named_params`` waits for its all-reduce before the
    optimizer can read the gradients.
    """

    @opts.check_ddp_args
    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Sequence[tuple[str, nn.Parameter]] | None = None,
        param_to_hook_all_reduce: nn.Parameter | None = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: Sequence[float] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        if not dist.is_initialized():
            raise RuntimeError(
                "DistributedDataParallel needs a process group: call "
                "phalanx.init_process_group() first (launch with `phalanx run`)"
            )
        opts.check_flags(delay_all_reduce_named_params, param_to_hook_all_reduce, check_reduction)
        self.process_group = opts.resolve_group(process_group, device_mesh)
        delayed = list(delay_all_reduce_named_params or [])
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self.parameters_to_ignore |= {name for name, _ in delayed}
        managed = self._managed_parameters(module)
        if not any(p.requires_grad for _, p in managed) and not delayed:
            raise RuntimeError(
                "DistributedDataParallel is not needed when a module doesn't have any parameter "
                "that requires a gradient."
            )
        devices = {p.device for _, p in managed} or {p.device for _, p in delayed}
        self.device_ids, self.output_device = opts.resolve_devices(
            device_ids, output_device, devices
        )
        opts.refuse_uninitialized(managed)
        self.module = module
        self.dim = dim
        self.device = (managed or delayed)[0][1].device  # torch: the first parameter's
        self.device_type = self.device.type
        self.is_multi_device_module = len(devices) > 1
        sync = opts.buffer_sync(broadcast_buffers, forward_sync_buffers)
        self.forward_sync_buffers = sync.in_forward
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.batched_grad_copy = batched_grad_copy
        self.mixed_precision = mixed_precision
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._divide_by_initial_world_size = True
        self._caps = opts.bucket_caps(bucket_cap_mb, bucket_cap_mb_list)
        self.bucket_bytes_cap = self._caps.bucket_bytes_cap
        if init_sync:
            check_same_model(managed, self.process_group)
            self._broadcast_state(self._root(), with_buffers=sync.at_init)
        self._delayed_names = ([n for n, _ in delayed], _name_of(module, param_to_hook_all_reduce))
        self._delayed = self._build_delayed(broadcast=True)
        self._caster = (
            ParamCaster(mixed_precision, [p for _, p in managed], self._synced_buffers())
            if mixed_precision is not None
            else None
        )
        self.reducer = self._build_reducer()

    # ---- construction ----------------------------------------------------------------------
    def _managed_parameters(self, module: nn.Module) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in module.named_parameters() if n not in self.parameters_to_ignore]

    def _synced_buffers(self) -> list[torch.Tensor]:
        return [b for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore]

    def _build_reducer(self) -> Reducer | None:
        named = [(n, p) for n, p in self._managed_parameters(self.module) if p.requires_grad]
        if not named:
            return None  # every parameter is reduced by the delayed all-reduce
        sparse_names = opts.sparse_parameter_names(self.module)
        sparse = frozenset(i for i, (n, _) in enumerate(named) if n in sparse_names)
        options = ReducerOptions(
            find_unused=self.find_unused_parameters,
            grad_as_bucket_view=self.gradient_as_bucket_view,
            static_graph=self.static_graph,
            skip_unused=self.skip_all_reduce_unused_params,
            batched_copy=self.batched_grad_copy,
            sparse=sparse,
            bucket_dtype=self._caster.reduce_dtype if self._caster is not None else None,
        )
        reducer = Reducer(
            named, self.process_group, self.bucket_bytes_cap, caps=self._caps.caps, options=options
        )
        if self._caster is not None:
            reducer.before_write_back = self._caster.to_full
        return reducer

    def _build_delayed(self, broadcast: bool) -> DelayedAllReduce | None:
        names, trigger = self._delayed_names
        if not names:
            return None
        by_name = dict(self.module.named_parameters(remove_duplicate=False))
        params = [by_name[n] for n in names]
        src = self._root() if broadcast else None
        return DelayedAllReduce(params, by_name[trigger], self.process_group, src)

    def _root(self) -> int:
        return dist.get_global_rank(self.process_group, 0)

    def _broadcast_state(self, src: int, with_buffers: bool) -> None:
        tensors = [p.detach() for _, p in self._managed_parameters(self.module)]
        broadcast_coalesced(
            tensors + (self._synced_buffers() if with_buffers else []), src, self.process_group
        )

    def regroup(self, process_group: dist.ProcessGroup | None = None) -> None:
        """Reduce over ``process_group`` from now on (None: the current default group).

        For live recovery, which replaces the default group when ranks are lost or join
        (``phalanx.Job`` in a ``phalanx run --recovery live`` job calls it): the reducer is
        rebuilt, keeping a registered communication hook, and a reduction in flight is
        dropped. Nothing is broadcast: the caller makes the replicas equal.
        """
        old = self.reducer
        if old is not None:
            old.remove_hooks()
        if self._delayed is not None:
            self._delayed.remove()
        self.process_group = opts.resolve_group(process_group, None)
        self._delayed = self._build_delayed(broadcast=False)
        self.reducer = self._build_reducer()
        if old is not None and self.reducer is not None:
            self.reducer.hook, self.reducer.hook_state = old.hook, old.hook_state

    # ---- pickling: torch.save(ddp_model), copy.deepcopy -------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for transient in ("process_group", "reducer", "_delayed"):
            state.pop(transient, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # As torch: an unpickled DDP joins the default group and rebuilds its reducer.
        self.process_group = opts.resolve_group(None, None)
        super().__setstate__(state)
        self._delayed = self._build_delayed(broadcast=False)
        self.reducer = self._build_reducer()

    # ---- forward -----------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module after the collectives torch's DDP issues before a forward."""
        inputs, kwargs = self._pre_forward(inputs, kwargs)
        output = self.module(*inputs, **kwargs)
        self._post_forward()
        return output

    # Under torch.compile the bookkeeping around the module runs eagerly (as for torch's DDP):
    # only the wrapped module's forward is compiled.
    @eager
    def _pre_forward(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        grad_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        work = Join.notify_join_context(self)
        if self.reducer is not None:
            self.reducer.divisor = self._divisor(work)
        if self.will_sync_module_buffers():
            self._sync_buffers(candidate=True)
        if self._join_config.enable:
            self._agree_on_backward_sync(joined=False)
        if self.reducer is not None:
            self.reducer.require_backward_grad_sync = grad_sync
            self.reducer.site = GradSite(current_dist_autograd_context() if grad_sync else None)
        self.require_forward_param_sync = grad_sync  # torch's: the next forward syncs buffers
        if self.device_ids:
            inputs, kwargs = self.to_kwargs(inputs, kwargs, self.device_ids[0])
        if self._caster is not None:
            self._caster.to_low()
            if self.reducer is not None:
                self.reducer.rehook()
            inputs, kwargs = cast_inputs(self._caster.param_dtype, (inputs, kwargs))
        return inputs, kwargs

    @eager
    def _post_forward(self) -> None:
        if self._delayed is not None:
            self._delayed.point_grads()

    def _divisor(self, join_work: Any) -> int:
        size = dist.get_world_size(self.process_group)
        if join_work is None or self._divide_by_initial_world_size:
            return size
        return int(join_work.get_future().wait()[0].item())  # ranks not yet joined

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts module buffers first (torch's rule)."""
        return (
            self.require_forward_param_sync
            and self.forward_sync_buffers
            and bool(self._synced_buffers())
        )

    @property
    def broadcast_buffers(self) -> bool:
        """Deprecated alias of ``forward_sync_buffers``, as in torch."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def _sync_buffers(self, candidate: bool) -> None:
        # Under join, rank 0 may have joined with stale buffers: take a rank still training.
        if self._join_config.enable:
            src = common_rank(candidate, self.process_group, self.device)
        else:
            src = self._root()
        broadcast_coalesced(self._synced_buffers(), src, self.process_group)

    def _agree_on_backward_sync(self, joined: bool) -> bool:
        flag = torch.tensor(
            [0.0 if joined or not self.require_backward_grad_sync else 1.0], device=self.device
        )
        c.all_reduce(flag, dist.ReduceOp.SUM, self.process_group)
        return bool(flag.item() != 0)

    # ---- public API --------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) in backward passes run inside."""
        with sync_off(self):
            yield

    def register_comm_hook(self, state: Any, hook: Hook) -> None:
        """Replace the bucket all-reduce by ``hook(state, bucket) -> Future[Tensor]``.

        The contract is torch's: the future's value is the bucket's averaged flat buffer. Only
        one hook may be registered, before the first backward. Annotations, when present, must
        be torch's (``dist.GradBucket``, ``torch.futures.Future[torch.Tensor]``).
        """
        check_comm_hook(hook)
        if self.reducer is None:
            raise RuntimeError("register_comm_hook: every parameter's all-reduce is delayed")
        if self.reducer.hook is not None:
            raise RuntimeError(
                "register_comm_hook or register_builtin_comm_hook can only be called once."
            )
        self.reducer.hook, self.reducer.hook_state = hook, state

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """Train on uneven inputs: a rank that runs out of batches shadows the others.

        The same context manager as torch's ``ddp.join()`` (``Join([self], ...)``): on leaving
        it, a rank keeps issuing the others' collectives with zeros until every rank has left,
        then all take the model of the last rank to finish. ``divide_by_initial_world_size=False``
        averages each step over the ranks still training instead of the full world size.
        """
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook ``Join`` runs on this rank once it has joined."""
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        """Device of the join context's collectives."""
        return self.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        """Group of the join context's collectives."""
        return self.process_group

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        # Joined ranks skipped the optimizer steps of the others' extra batches: take the model
        # of a rank that trained to the end (the highest-ranked last joiner), as torch does.
        src = common_rank(is_last_joiner, self.process_group, self.device)
        self._broadcast_state(src, with_buffers=self.forward_sync_buffers)

    def to_kwargs(self, inputs: Any, kwargs: Any, device_id: int) -> tuple[Any, Any]:
        """Move inputs and keyword inputs to ``device_id`` (torch's method)."""
        device = torch.device(self.device_type, device_id)
        return map_tensors(
            lambda t: t.to(device, non_blocking=True), (tuple(inputs), dict(kwargs or {}))
        )

    def scatter(self, inputs: Any, kwargs: Any, device_ids: Sequence[int]) -> tuple[Any, Any]:
        """Split inputs along ``dim`` across ``device_ids`` (torch's method)."""
        devices = [torch.device(self.device_type, d) for d in device_ids]
        return scatter(tuple(inputs), devices, self.dim), scatter(
            dict(kwargs or {}), devices, self.dim
        )

    def gather(self, outputs: Any, output_device: int) -> Any:
        """Concatenate per-device outputs on ``output_device`` (torch's method)."""
        return gather(outputs, torch.device(self.device_type, output_device), self.dim)

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(
        module: nn.Module, names: Sequence[str]
    ) -> None:
        """Leave these parameters and buffers out of synchronisation (torch's static method)."""
        module._ddp_params_and_buffers_to_ignore = names  # type: ignore[assignment]
        for name, param in module.named_parameters():
            if name in names:
                param._ddp_ignored = True  # type: ignore[attr-defined]


def _name_of(module: nn.Module, param: nn.Parameter | None) -> str:
    """The name of ``param`` in ``module`` (pickling keeps names, not identities)."""
    if param is None:
        return ""
    for name, p in module.named_parameters(remove_duplicate=False):
        if p is param:
            return name
    raise ValueError(
        "DistributedDataParallel: param_to_hook_all_reduce is not a parameter of the module"
    )
