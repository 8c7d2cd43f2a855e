"""Share one model's parameters among the ranks of one machine that were launched separately.

``phalanx.hogwild.train`` starts its own processes and hands them a ``share_memory()`` model.
Ranks started by ``phalanx run`` are independent processes, so there is nothing to inherit:
instead every rank maps the same file in ``/dev/shm`` with ``MAP_SHARED``
(``torch.from_file(..., shared=True)``) and points its parameters at views of it. Rank 0 writes
the initial values; once every rank has mapped the file it is unlinked, so nothing is left
behind even if the job is killed, and the mapping lives as long as the processes.

The file name travels as a uint8 tensor broadcast over the group (no pickle).
"""

from __future__ import annotations

import os
import tempfile
import uuid

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["share_parameters"]

_NAME_BYTES = 256


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _agree_on_path(group: dist.ProcessGroup | None) -> str:
    buf = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
    if dist.get_rank(group) == 0:
        path = os.path.join(_shm_dir(), f"phalanx-hogwild-{os.getpid()}-{uuid.uuid4().hex}")
        raw = path.encode()
        buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    dist.broadcast(buf, dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return bytes(buf[buf != 0].tolist()).decode()


def _shared_tensors(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor, bool]]:
    out: list[tuple[nn.Module, str, torch.Tensor, bool]] = []
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                out.append((module, name, p, True))
        for name, b in module._buffers.items():
            if b is not None and b.is_floating_point():
                out.append((module, name, b, False))
    return out


def share_parameters(model: nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """Point ``model``'s parameters and floating buffers at memory shared by the group's ranks.

    Every rank of ``group`` must be on this machine. Parameters stay the same objects (their
    ``.data`` changes), so an optimizer built before this call keeps working; all ranks start
    from rank 0's values.

    Returns:
        The number of shared elements.

    Raises:
        ValueError: when a tensor is not on the CPU, or dtypes are mixed (naming the tensor).
    """
    tensors = _shared_tensors(model)
    dtype = tensors[0][2].dtype
    for module, name, t, _ in tensors:
        if t.device.type != "cpu" or t.dtype != dtype:
            raise ValueError(
                f"Hogwild shares CPU memory of one dtype: {type(module).__name__}.{name} is "
                f"{t.dtype} on {t.device}, the first tensor is {dtype} on cpu"
            )
    total = sum(t.numel() for _, _, t, _ in tensors)
    path = _agree_on_path(group)
    rank = dist.get_rank(group)
    if rank == 0:
        flat = torch.from_file(path, shared=True, size=total, dtype=dtype)
        offset = 0
        for _, _, t, _ in tensors:
            flat[offset : offset + t.numel()].copy_(t.detach().reshape(-1))
            offset += t.numel()
    dist.barrier(group=group)
    if rank != 0:
        flat = torch.from_file(path, shared=True, size=total, dtype=dtype)
    offset = 0
    for module, name, t, is_param in tensors:
        view = flat[offset : offset + t.numel()].view_as(t)
        offset += t.numel()
        if is_param:
            t.data = view
        else:
            module._buffers[name] = view
    dist.barrier(group=group)
    if rank == 0:
        os.unlink(path)  # every rank holds its mapping; the name is no longer needed
    return total
