"""Object collectives (torch's signatures) over the pickle-free codec in ``codec.py``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from phalanx._check import fail
from phalanx.comm import collectives as c
from phalanx.comm.codec import decode, encode

__all__ = ["all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list"]


def _device(group: c.Group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _to_bytes_tensor(obj: Any, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(encode(obj)), dtype=torch.uint8).to(device)


def _padded(t: torch.Tensor, size: int) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.uint8, device=t.device)
    out[: t.numel()] = t
    return out


def _sizes(n: int, group: c.Group, device: torch.device) -> list[int]:
    world = dist.get_world_size(group)
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    allsz = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    c.all_gather(allsz, mine, group)
    return [int(s.item()) for s in allsz]


def _decode(t: torch.Tensor, n: int) -> Any:
    return decode(t[:n].cpu().numpy().tobytes())


def all_gather_object(object_list: list[Any], obj: Any, group: c.Group = None) -> None:
    """Gather ``obj`` from every rank into ``object_list`` (length = group size)."""
    c.check_args("all_gather_object", group, object_list=object_list)
    world = dist.get_world_size(group)
    if len(object_list) != world:
        what = f"a list of one entry per rank ({world})"
        raise fail("object_list", object_list, what, where="all_gather_object")
    device = _device(group)
    data = _to_bytes_tensor(obj, device)
    sizes = _sizes(data.numel(), group, device)
    width = max(sizes)
    out = [torch.empty(width, dtype=torch.uint8, device=device) for _ in sizes]
    c.all_gather(out, _padded(data, width), group)
    for i, (t, n) in enumerate(zip(out, sizes)):
        object_list[i] = _decode(t, n)


def broadcast_object_list(object_list: list[Any], src: int = 0, group: c.Group = None) -> None:
    """Replace ``object_list``'s entries on every rank by those of global rank ``src``."""
    c.check_args("broadcast_object_list", group, object_list=object_list, src=src)
    device = _device(group)
    if dist.get_rank() == src:
        parts = [_to_bytes_tensor(o, device) for o in object_list]
        sizes = torch.tensor([p.numel() for p in parts], dtype=torch.int64, device=device)
    else:
        sizes = torch.zeros(len(object_list), dtype=torch.int64, device=device)
    c.broadcast(sizes, src, group)
    total = int(sizes.sum().item())
    if dist.get_rank() == src:
        payload = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    else:
        payload = torch.empty(total, dtype=torch.uint8, device=device)
    c.broadcast(payload, src, group)
    if dist.get_rank() != src:
        offset = 0
        for i, n in enumerate(sizes.tolist()):
            object_list[i] = _decode(payload[offset : offset + n], n)
            offset += n


def gather_object(
    obj: Any, object_gather_list: list[Any] | None = None, dst: int = 0, group: c.Group = None
) -> None:
    """Gather ``obj`` from every rank into ``object_gather_list`` on global rank ``dst``."""
    c.check_args("gather_object", group, object_gather_list=object_gather_list, dst=dst)
    device = _device(group)
    data = _to_bytes_tensor(obj, device)
    sizes = _sizes(data.numel(), group, device)
    width = max(sizes)
    is_dst = dist.get_rank() == dst
    if is_dst and object_gather_list is None:
        raise ValueError(f"object_gather_list must be a list on the destination rank {dst}")
    out = [torch.empty(width, dtype=torch.uint8, device=device) for _ in sizes] if is_dst else None
    c.gather(_padded(data, width), out, dst, group)
    if is_dst:
        assert out is not None and object_gather_list is not None
        for i, (t, n) in enumerate(zip(out, sizes)):
            object_gather_list[i] = _decode(t, n)


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int = 0,
    group: c.Group = None,
) -> None:
    """Send ``scatter_object_input_list[i]`` from ``src`` to rank i's output list entry 0."""
    c.check_args(
        "scatter_object_list",
        group,
        scatter_object_output_list=scatter_object_output_list,
        scatter_object_input_list=scatter_object_input_list,
        src=src,
    )
    if not scatter_object_output_list:
        what = "a list with room for one object, e.g. [None]"
        where = "scatter_object_list"
        raise fail("scatter_object_output_list", scatter_object_output_list, what, where=where)
    device = _device(group)
    world = dist.get_world_size(group)
    is_src = dist.get_rank() == src
    if is_src:
        if scatter_object_input_list is None or len(scatter_object_input_list) != world:
            raise ValueError(
                f"scatter_object_input_list on rank {src} must hold {world} objects (one per rank)"
            )
        parts = [_to_bytes_tensor(o, device) for o in scatter_object_input_list]
        sizes = torch.tensor([p.numel() for p in parts], dtype=torch.int64, device=device)
    else:
        sizes = torch.zeros(world, dtype=torch.int64, device=device)
    c.broadcast(sizes, src, group)
    width = int(sizes.max().item())
    mine = torch.empty(width, dtype=torch.uint8, device=device)
    c.scatter(mine, [_padded(p, width) for p in parts] if is_src else None, src, group)
    rank_in_group = dist.get_rank(group)
    scatter_object_output_list[0] = _decode(mine, int(sizes[rank_in_group].item()))
