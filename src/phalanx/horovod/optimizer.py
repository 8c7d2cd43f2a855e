"""``DistributedOptimizer``: Horovod's optimizer wrapper, on DDP's bucketed all-reduce engine.

As in Horovod, the result is an instance of a class derived from the wrapped optimizer's own
(so ``isinstance(opt, torch.optim.SGD)`` holds and learning-rate schedulers accept it). Unlike
Horovod, it shares the wrapped optimizer's state and param_groups instead of starting empty.
Gradients are averaged during backward, bucket by bucket (see ``backward_allreduce.py``); ``step()``
then only has to apply them.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from phalanx._check import check_int
from phalanx.horovod.allreduce import ReduceOp, resolve_op
from phalanx.horovod.backward_allreduce import GradientSync, bucket_cap_bytes, check_same_parameters
from phalanx.horovod.compression import Compression, check_compression
from phalanx.horovod.process_sets import resolve

__all__ = ["DistributedOptimizer"]

_OWN = ("step", "zero_grad", "load_state_dict", "synchronize", "skip_synchronize")


class _DistributedOptimizer(torch.optim.Optimizer):
    """Placed before the wrapped optimizer's class in the MRO of the returned object's class."""

    _hvd_sync: GradientSync | None
    _hvd_skip: bool
    _hvd_synchronized: bool
    _parameter_names: dict[torch.Tensor, str]

    def synchronize(self) -> None:
        """Make sure every gradient is all-reduced (they normally are when backward returns)."""
        self._hvd_synchronize()
        self._hvd_synchronized = True

    def _hvd_synchronize(self) -> None:
        if self._hvd_sync is not None:
            self._hvd_sync.synchronize()

    def _hvd_plain_step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The wrapped optimizer's step, without synchronizing (broadcast_optimizer_state)."""
        return super().step(closure)

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside this block does not synchronize (after an explicit synchronize)."""
        previous, self._hvd_skip = self._hvd_skip, True
        try:
            yield
        finally:
            self._hvd_skip = previous

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Synchronize the gradients (unless skipped), then take the wrapped optimizer's step.

        After an explicit ``synchronize()``, call ``step()`` inside ``skip_synchronize()``;
        otherwise a warning says so, as Horovod's does.
        """
        if not self._hvd_skip:
            if self._hvd_synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(); wrap step() in `with optimizer.skip_synchronize():`",
                    stacklevel=2,
                )
            self._hvd_synchronize()
        self._hvd_synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients; refused halfway through ``backward_passes_per_step`` passes."""
        sync = self._hvd_sync
        if sync is not None and sync.passes > 0:
            raise RuntimeError(
                f"optimizer.zero_grad() was called after {sync.passes} of "
                f"backward_passes_per_step={sync.passes_per_step} backward passes, before "
                f"optimizer.step() or optimizer.synchronize(): the accumulated gradients would be "
                f"lost. Call step() (or synchronize()) first, as with Horovod."
            )
        super().zero_grad(set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped optimizer's state; restarts the count of backward passes."""
        if self._hvd_sync is not None:
            self._hvd_sync.reset()
        self._hvd_synchronized = False
        super().load_state_dict(state_dict)

    @property
    def backward_passes_per_step(self) -> int:
        """Backward passes accumulated locally per all-reduce."""
        return self._hvd_sync.passes_per_step if self._hvd_sync is not None else 1

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change the number of backward passes accumulated per all-reduce."""
        _check_passes(passes)
        if self._hvd_sync is not None:
            self._hvd_sync.set_passes_per_step(passes)


_CLASSES: dict[type, type[_DistributedOptimizer]] = {}


def _wrapped_class(base: type) -> type[_DistributedOptimizer]:
    if base not in _CLASSES:
        _CLASSES[base] = type(base.__name__, (_DistributedOptimizer, base), {})
    return _CLASSES[base]


def _check_passes(passes: Any) -> None:
    check_int("backward_passes_per_step", passes, min=1, where="hvd.DistributedOptimizer")


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[tuple[str, nn.Parameter]]:
    """Every parameter of the optimizer, with where it sits (for names and messages)."""
    return [
        (f"param_groups[{i}]['params'][{j}]", p)
        for i, group in enumerate(optimizer.param_groups)
        for j, p in enumerate(group["params"])
    ]


def _named(
    optimizer: torch.optim.Optimizer, named_parameters: Iterable[Any] | None
) -> list[tuple[str, nn.Parameter]]:
    """The optimizer's trainable parameters with their names, in ``named_parameters`` order."""
    located = _optimizer_params(optimizer)
    if named_parameters is None:
        named = [(f"allreduce.noname.{where}", p) for where, p in located]
    else:
        named = list(named_parameters)
        if any(not (isinstance(x, tuple) and len(x) == 2) for x in named):
            raise ValueError(
                "named_parameters must be (name, parameter) pairs, as produced by "
                "model.named_parameters()"
            )
        dups = sorted(n for n, k in Counter(n for n, _ in named).items() if k > 1)
        if dups:
            raise ValueError(
                f"named_parameters: parameter names must be unique, found duplicates {dups}"
            )
        given = {id(p) for _, p in named}
        missing = [f"{where} (shape {list(p.shape)})" for where, p in located if id(p) not in given]
        if missing:
            raise ValueError(
                f"named_parameters was given but lacks {len(missing)} parameter(s) of the "
                f"optimizer: {', '.join(missing[:10])}; pass model.named_parameters() of the "
                f"model the optimizer trains"
            )
        in_optimizer = {id(p) for _, p in located}
        named = [(n, p) for n, p in named if id(p) in in_optimizer]
    seen: set[int] = set()
    out = []
    for n, p in named:  # a parameter listed under two names is synchronised once
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((n, p))
    return out


def _bucket_groups(num_groups: int, groups: Any) -> int:
    if num_groups:
        warnings.warn(
            "num_groups is deprecated (as in Horovod); use groups=",
            DeprecationWarning,
            stacklevel=3,
        )
        groups = groups if groups is not None else num_groups
    if groups is None:
        return 0
    if isinstance(groups, int) and not isinstance(groups, bool) and groups >= 0:
        return groups
    if isinstance(groups, list) and all(
        isinstance(g, (list, tuple)) and all(isinstance(p, torch.Tensor) for p in g) for g in groups
    ):
        warnings.warn(
            f"groups: phalanx packs gradients into {len(groups)} buckets by size and "
            f"parameter order, not by the lists given",
            stacklevel=3,
        )
        return len(groups)
    raise ValueError(
        f"groups must be a non-negative integer or a list of lists of parameters, got {groups!r}"
    )


def DistributedOptimizer(  # Horovod's name
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, nn.Parameter]] | None = None,
    compression: Any = Compression.none,
    backward_passes_per_step: int = 1,
    op: Any = ReduceOp.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: Any = None,
    *,
    find_unused_parameters: bool = True,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that gradients are averaged (or summed) across ranks in backward.

    Args:
        optimizer: The ``torch.optim`` optimizer to wrap; its state and param_groups are shared.
        named_parameters: ``model.named_parameters()``; names appear in error messages.
        compression: ``hvd.Compression.none`` or ``hvd.Compression.fp16`` (on the wire).
        backward_passes_per_step: Backward passes accumulated locally per all-reduce.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        gradient_predivide_factor: Divide by this before the sum and by N/f after (Average).
        num_groups: Deprecated alias of an integer ``groups``.
        groups: An integer: number of buckets (all-reduces) per step.
        sparse_as_dense: All-reduce sparse gradients as dense ones (turned back into sparse
            tensors for the optimizer); else they are all-gathered at ``synchronize()``.
        process_set: An ``hvd.ProcessSet`` to synchronise over; None for all ranks. On ranks
            outside the set the optimizer is local.
        find_unused_parameters: phalanx extension. True (default, Horovod's tolerance): a
            parameter may miss its gradient in a backward pass, at the cost of one small
            all-reduce per step; False saves it and names any parameter that misses one.

    Returns:
        An optimizer of the wrapped class with ``synchronize()`` and ``skip_synchronize()``.
    """
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("optimizer is already a DistributedOptimizer; wrap the plain one once")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    op = resolve_op(op)
    if op not in (ReduceOp.Average, ReduceOp.Sum):
        raise ValueError(f"op={op.name} is not supported for gradients, use Average or Sum")
    if gradient_predivide_factor != 1.0 and op != ReduceOp.Average:
        raise ValueError(
            f"gradient_predivide_factor={gradient_predivide_factor} needs "
            f"op=hvd.Average, got op=hvd.{op.name}"
        )
    if gradient_predivide_factor <= 0:
        raise ValueError(
            f"gradient_predivide_factor must be positive, got {gradient_predivide_factor}"
        )
    _check_passes(backward_passes_per_step)
    check_compression(compression)
    n_buckets = _bucket_groups(num_groups, groups)
    ps = resolve(process_set, member=False)
    named = _named(optimizer, named_parameters)
    sync = None
    if named and ps.included() and len(ps.ranks) > 1:
        check_same_parameters(named, ps.group)
        cap = bucket_cap_bytes([p for _, p in named], n_buckets)
        sync = GradientSync(
            named,
            ps,
            compression,
            op,
            gradient_predivide_factor,
            backward_passes_per_step,
            cap,
            cap if n_buckets else None,
            find_unused_parameters,
            sparse_as_dense,
        )
    cls = _wrapped_class(type(optimizer))
    wrapped = object.__new__(cls)
    # Share state and param_groups; skip instance-level overrides of our methods (an LR
    # scheduler patches ``optimizer.step`` on the instance) so that ours are the ones called.
    wrapped.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k not in _OWN})
    wrapped._hvd_sync = sync
    wrapped._hvd_skip = False
    wrapped._hvd_synchronized = False
    wrapped._parameter_names = {p: n for n, p in named}
    return wrapped
