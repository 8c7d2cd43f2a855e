"""Start-of-training helpers: broadcast parameters, optimizer state and plain objects.

``broadcast_optimizer_state`` sends the root's whole ``optimizer.state_dict()``: its structure
and hyper-parameters (lr, momentum, betas, ...) through phalanx's pickle-free object broadcast,
its tensors as one flat broadcast per dtype; the other ranks load it. So an optimizer whose state
is still empty (before its first step) ends up exactly like the root's, with no dummy
zero-gradient step (which Horovod uses, and which moves parameters under weight decay).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from phalanx.comm import collectives as c
from phalanx.comm.objects import all_gather_object, broadcast_object_list
from phalanx.horovod.basics import ProcessSet, check_group

__all__ = [
    "allgather_object",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
]

_TENSOR_KEY = "__phalanx_tensor__"


def broadcast_coalesced(tensors: list[torch.Tensor], root: int, group: ProcessSet) -> None:
    """Overwrite ``tensors`` with the root's, one flat broadcast per (device, dtype)."""
    kinds: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        kinds.setdefault((t.device, t.dtype), []).append(t)
    with torch.no_grad():
        for same in kinds.values():
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            c.broadcast(flat, root, group)
            if dist.get_rank() == root:
                continue
            offset = 0
            for t in same:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


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
    bad = [name if name is not None else i for i, (name, t) in enumerate(items)
           if not isinstance(t, torch.Tensor)]  # fmt: skip
    if bad:
        raise ValueError(f"params: entries {bad[:10]} are not tensors")
    return items


def broadcast_parameters(params: Any, root_rank: int, process_set: ProcessSet = None) -> None:
    """Overwrite every rank's tensors in ``params`` with ``root_rank``'s, in place.

    Args:
        params: ``model.state_dict()``, ``model.named_parameters()`` or ``model.parameters()``
            (any iterable of tensors or of (name, tensor) pairs).
        root_rank: Global rank whose values everyone takes.
        process_set: Group to broadcast within; None for all ranks.
    """
    group = check_group(process_set, root_rank)
    broadcast_coalesced([t for _, t in _named_tensors(params)], root_rank, group)


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
    return [torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            for _, shape, dtype in found]  # fmt: skip


def broadcast_tree(obj: Any, root_rank: int, group: ProcessSet) -> Any:
    """Return the root's ``obj`` (plain data and tensors, nested) on every rank."""
    tensors: list[torch.Tensor] = []
    skeleton = _split(obj, tensors) if dist.get_rank() == root_rank else None
    box = [skeleton]
    broadcast_object_list(box, root_rank, group)
    device = _comm_device(group)
    if dist.get_rank() == root_rank:  # same devices on every rank: the same flat broadcasts
        tensors = [t.to(device) for t in tensors]
    else:
        tensors = _empty_like_placeholders(box[0], device)
    broadcast_coalesced(tensors, root_rank, group)
    return obj if dist.get_rank() == root_rank else _join(box[0], tensors)


def _comm_device(group: ProcessSet) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None,
    process_set: ProcessSet = None,
) -> None:  # fmt: skip
    """Make every rank's optimizer state and hyper-parameters equal to ``root_rank``'s.

    Args:
        optimizer: A ``torch.optim`` optimizer, or one wrapped by ``DistributedOptimizer``.
        root_rank: Global rank whose state everyone takes.
        model: Accepted for compatibility (Horovod used it to find sparse parameters).
        process_set: Group to broadcast within; None for all ranks.
    """
    group = check_group(process_set, root_rank)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")  # fmt: skip
    me = dist.get_rank()
    state = broadcast_tree(optimizer.state_dict() if me == root_rank else None, root_rank, group)
    if me == root_rank:
        return
    try:
        optimizer.load_state_dict(state)
    except ValueError as exc:
        raise ValueError(f"[rank {me}] broadcast_optimizer_state: rank {root_rank}'s optimizer "
                         f"does not fit this rank's: {exc}") from exc  # fmt: skip


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: ProcessSet = None
) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank.

    Objects travel through phalanx's pickle-free encoding: None, bool, int, float, str, bytes,
    lists, tuples, sets, dicts and tensors (a TypeError names anything else), so a peer can
    never make this rank run code. Horovod's version pickles.
    """
    box = [obj]
    broadcast_object_list(box, root_rank, check_group(process_set, root_rank))
    return box[0]


def allgather_object(
    obj: Any, name: str | None = None, process_set: ProcessSet = None
) -> list[Any]:
    """Return every rank's ``obj``, in rank order (pickle-free, as :func:`broadcast_object`)."""
    group = check_group(process_set)
    out: list[Any] = [None] * dist.get_world_size(group)
    all_gather_object(out, obj, group)
    return out
