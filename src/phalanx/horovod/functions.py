"""Start-of-training helpers: broadcast parameters, optimizer state and plain objects.

``broadcast_optimizer_state`` first gives an optimizer whose state is still empty Horovod's
dummy step with zero gradients (so its state tensors exist, on every rank; note that weight
decay moves the parameters in that step, as in Horovod), then sends the root's whole
``optimizer.state_dict()``: structure and hyper-parameters (lr, momentum, betas, ...) through
phalanx's pickle-free object broadcast, tensors as one flat broadcast per dtype; the other ranks
load it. Every step is negotiated like the other operations, so models or optimizers that differ
across ranks raise a ``RuntimeError`` on every rank naming the shapes, instead of corrupting
memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from phalanx.comm import collectives as c
from phalanx.comm.objects import all_gather_object, broadcast_object_list
from phalanx.data_parallel.coalesce import copy_back, flatten, group_by_kind
from phalanx.horovod import dtypes
from phalanx.horovod.process_sets import ProcessSet, controller, resolve
from phalanx.horovod.protocol import Kind
from phalanx.horovod.requests import Agreement, Request

__all__ = [
    "allgather_object",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
]

_TENSOR_KEY = "__phalanx_tensor__"


def _start_coalesced(req: Request, agreement: Agreement) -> tuple[list[Any], Callable[[], None]]:
    group, root = req.options["group"], req.root
    works, flats = [], []
    for indices in group_by_kind(req.tensors):
        same = [req.tensors[i] for i in indices]
        flat = flatten(same, dtypes.wire_dtype(same[0].dtype))
        works.append(c.broadcast(flat, root, group, async_op=True))
        flats.append((same, flat))

    def result() -> None:
        if dist.get_rank() == root:
            return
        for same, flat in flats:
            copy_back(flat, same)

    return works, result


def broadcast_coalesced(tensors: list[torch.Tensor], root: int, ps: ProcessSet) -> None:
    """Overwrite ``tensors`` with the root's, one flat broadcast per (device, dtype)."""
    req = Request(
        Kind.BROADCAST_PARAMETERS,
        None,
        tensors,
        _start_coalesced,
        root=root,
        options={"group": ps.group},
    )
    controller(ps).submit(req, blocking=True).wait()


def _object_request(kind: Kind, obj: Any, root: int, ps: ProcessSet, name: str | None) -> Any:
    box: list[Any] = [obj] if kind == Kind.BROADCAST_OBJECT else [None] * len(ps.ranks)

    def start(req: Request, agreement: Agreement) -> tuple[list[Any], Callable[[], Any]]:
        if kind == Kind.BROADCAST_OBJECT:
            broadcast_object_list(box, root, ps.group)
            return [], lambda: box[0]
        all_gather_object(box, obj, ps.group)
        return [], lambda: box

    req = Request(kind, name, [], start, root=root)
    return controller(ps).submit(req, blocking=True).wait()


def _named_tensors(params: Any) -> list[tuple[str | None, torch.Tensor]]:
    if isinstance(params, dict):
        items: list[Any] = sorted(params.items(), key=lambda kv: str(kv[0]))
    elif isinstance(params, Iterable) and not isinstance(params, torch.Tensor):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(
            f"params must be a state_dict, model.named_parameters() or model.parameters(), "
            f"got {type(params).__name__}"
        )
    bad = [
        name if name is not None else i
        for i, (name, t) in enumerate(items)
        if not isinstance(t, torch.Tensor)
    ]
    if bad:
        raise ValueError(f"params: entries {bad[:10]} are not tensors")
    return items


def broadcast_parameters(params: Any, root_rank: int, process_set: Any = None) -> None:
    """Overwrite every rank's tensors in ``params`` with ``root_rank``'s, in place.

    Args:
        params: ``model.state_dict()``, ``model.named_parameters()`` or ``model.parameters()``
            (any iterable of tensors or of (name, tensor) pairs).
        root_rank: Global rank whose values everyone takes.
        process_set: An ``hvd.ProcessSet`` to broadcast within; None for all ranks.
    """
    ps = resolve(process_set, root_rank)
    broadcast_coalesced([t for _, t in _named_tensors(params)], root_rank, ps)


# ---- objects that contain tensors: structure by object broadcast, tensors in bulk ---------------
def _split(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """Replace every tensor in ``obj`` by a placeholder naming its index, shape and dtype."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        dtype = str(obj.dtype).removeprefix("torch.")
        return {_TENSOR_KEY: [len(tensors) - 1, list(obj.shape), dtype]}
    if isinstance(obj, dict):
        return {k: _split(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_split(v, tensors) for v in obj)
    return obj


def _join(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {_TENSOR_KEY}:
            return tensors[obj[_TENSOR_KEY][0]]
        return {k: _join(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_join(v, tensors) for v in obj)
    return obj


def _empty_like_placeholders(skeleton: Any, device: torch.device) -> list[torch.Tensor]:
    found: list[tuple[int, list[int], str]] = []

    def walk(o: Any) -> None:
        if isinstance(o, dict):
            if set(o) == {_TENSOR_KEY}:
                found.append(o[_TENSOR_KEY])
                return
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(skeleton)
    found.sort(key=lambda f: f[0])
    return [
        torch.empty(shape, dtype=getattr(torch, dtype), device=device) for _, shape, dtype in found
    ]


def broadcast_tree(obj: Any, root_rank: int, ps: ProcessSet) -> Any:
    """Return the root's ``obj`` (plain data and tensors, nested) on every rank."""
    tensors: list[torch.Tensor] = []
    skeleton = _split(obj, tensors) if dist.get_rank() == root_rank else None
    skeleton = _object_request(Kind.BROADCAST_OBJECT, skeleton, root_rank, ps, None)
    device = _comm_device(ps.group)
    if dist.get_rank() == root_rank:  # same devices on every rank: the same flat broadcasts
        tensors = [t.to(device) for t in tensors]
    else:
        tensors = _empty_like_placeholders(skeleton, device)
    broadcast_coalesced(tensors, root_rank, ps)
    return obj if dist.get_rank() == root_rank else _join(skeleton, tensors)


def _comm_device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _dummy_step(optimizer: torch.optim.Optimizer) -> None:
    """Horovod's state initialisation: one step with zero gradients, no communication."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam):
                    p.grad = p.grad.to_sparse()
    # A DistributedOptimizer's step() would all-reduce: take the wrapped class's step instead.
    plain = getattr(optimizer, "_hvd_plain_step", None)
    (plain or optimizer.step)()


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer,
    root_rank: int,
    model: Any = None,
    process_set: Any = None,
) -> None:
    """Make every rank's optimizer state and hyper-parameters equal to ``root_rank``'s.

    An optimizer with no state yet first takes Horovod's dummy step on every rank where it is
    empty: the gradients of its trainable parameters are set to zeros (replacing any) and the
    wrapped optimizer steps once, without communication, so its state tensors exist.

    Args:
        optimizer: A ``torch.optim`` optimizer, or one wrapped by ``DistributedOptimizer``.
        root_rank: Global rank whose state everyone takes.
        model: Accepted for compatibility (Horovod used it to find sparse parameters).
        process_set: An ``hvd.ProcessSet`` to broadcast within; None for all ranks.
    """
    ps = resolve(process_set, root_rank)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            "broadcast_optimizer_state: torch.optim.LBFGS state cannot be broadcast (as in "
            "Horovod); broadcast the model parameters and start the optimizer afresh"
        )
    if not optimizer.state_dict()["state"]:
        _dummy_step(optimizer)
    me = dist.get_rank()
    state = broadcast_tree(optimizer.state_dict() if me == root_rank else None, root_rank, ps)
    if me == root_rank:
        return
    try:
        optimizer.load_state_dict(state)
    except ValueError as exc:
        raise ValueError(
            f"[rank {me}] broadcast_optimizer_state: rank {root_rank}'s optimizer "
            f"does not fit this rank's: {exc}"
        ) from exc


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = None
) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank.

    Objects travel through phalanx's pickle-free encoding: None, bool, int, float, str, bytes,
    lists, tuples, sets, dicts and tensors (a TypeError names anything else), so a peer can
    never make this rank run code. Horovod's version pickles.
    """
    ps = resolve(process_set, root_rank)
    return _object_request(Kind.BROADCAST_OBJECT, obj, root_rank, ps, name)


def allgather_object(obj: Any, name: str | None = None, process_set: Any = None) -> list[Any]:
    """Return every rank's ``obj``, in rank order (pickle-free, as :func:`broadcast_object`)."""
    return _object_request(Kind.ALLGATHER_OBJECT, obj, -1, resolve(process_set), name)
