"""torch's ``DistributedDataParallel`` constructor arguments, checked and resolved (pure).

Each function takes the arguments a user typed and returns what the wrapper will do, raising
the exception type torch raises for the same mistake (a drop-in must fail the same way) with a
message that names the argument and its value.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx._check import (
    FLAG,
    GROUP,
    MODULE,
    check_device,
    check_float,
    check_instance,
    check_int,
    checked,
    optional,
    part_of,
    rule,
)

__all__ = [
    "BucketCaps",
    "BufferSync",
    "bucket_caps",
    "buffer_sync",
    "check_ddp_args",
    "check_flags",
    "refuse_uninitialized",
    "resolve_devices",
    "resolve_group",
    "sparse_parameter_names",
]

MIB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25
FIRST_BUCKET_BYTES = 1024 * 1024
"""torch's first-bucket cap when ``bucket_cap_mb`` is left at its default."""


@dataclass(frozen=True)
class BucketCaps:
    """Byte caps of the gradient buckets, in launch order; the last one repeats."""

    caps: tuple[int, ...]

    @property
    def bucket_bytes_cap(self) -> int:
        """The largest cap (torch's ``ddp.bucket_bytes_cap``)."""
        return max(self.caps)

    def cap(self, k: int) -> int:
        """The cap of bucket ``k``."""
        return self.caps[min(k, len(self.caps) - 1)]


def bucket_caps(
    bucket_cap_mb: float | None, bucket_cap_mb_list: Sequence[float] | None
) -> BucketCaps:
    """torch's rule: 25 MiB buckets behind a 1 MiB first one, unless the user sets a cap.

    ``bucket_cap_mb_list`` gives each bucket its own cap (the last one repeats) and wins over
    ``bucket_cap_mb``. Both are checked by :data:`check_ddp_args`.
    """
    if bucket_cap_mb_list:
        return BucketCaps(tuple(int(mb * MIB) for mb in bucket_cap_mb_list))
    if bucket_cap_mb is None:
        return BucketCaps((FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_MB * MIB))
    return BucketCaps((int(bucket_cap_mb * MIB),))


def _mib(name: str, value: Any, where: str) -> float:
    return check_float(name, value, above=0, where=where, fix="a size in MiB, e.g. 25")


def _mib_list(name: str, value: Any, where: str) -> list[float]:
    check_instance(name, value, list | tuple, "a list of sizes in MiB", where=where)
    with part_of(name, value, where):
        return [_mib(f"{name}[{i}]", mb, "") for i, mb in enumerate(value)]


def _device(name: str, value: Any, where: str) -> object:
    return check_device(name, value, where=where)


def _device_ids(name: str, value: Any, where: str) -> list[Any]:
    check_instance(
        name, value, list | tuple, "a list of one device, e.g. [local_rank]", where=where
    )
    with part_of(name, value, where):
        return [_device(f"{name}[{i}]", d, "") for i, d in enumerate(value)]


check_ddp_args = checked(
    module=MODULE,
    device_ids=optional(_device_ids),
    output_device=optional(_device),
    dim=rule(check_int),
    broadcast_buffers=optional(FLAG),
    init_sync=FLAG,
    process_group=GROUP,
    bucket_cap_mb=optional(_mib),
    find_unused_parameters=FLAG,
    check_reduction=FLAG,
    gradient_as_bucket_view=FLAG,
    static_graph=FLAG,
    skip_all_reduce_unused_params=FLAG,
    bucket_cap_mb_list=optional(_mib_list),
    batched_grad_copy=FLAG,
    forward_sync_buffers=optional(FLAG),
)
"""Decorates ``DistributedDataParallel.__init__``: the type and range of every argument."""


@dataclass(frozen=True)
class BufferSync:
    """When module buffers follow the reference rank."""

    at_init: bool
    """Broadcast them once, when the wrapper is built."""
    in_forward: bool
    """Broadcast them before each forward that follows a synchronising one."""


def buffer_sync(broadcast_buffers: bool | None, forward_sync_buffers: bool | None) -> BufferSync:
    """torch 2.13's rule, with its deprecation warnings for ``broadcast_buffers``.

    ``forward_sync_buffers`` (the new name) always syncs at init; ``broadcast_buffers=False``
    (deprecated) also skips the init sync; neither given means both on.
    """
    if broadcast_buffers is not None:
        if forward_sync_buffers is not None:
            warnings.warn(
                "Both `broadcast_buffers` and `forward_sync_buffers` were specified. "
                "`broadcast_buffers` is deprecated and its value is ignored when "
                "`forward_sync_buffers` is provided.",
                FutureWarning,
                stacklevel=4,  # the user: buffer_sync, __init__, its argument check
            )
        else:
            warnings.warn(
                "`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. Unlike "
                "`broadcast_buffers=False`, `forward_sync_buffers=False` still syncs buffers at "
                "init.",
                FutureWarning,
                stacklevel=4,  # the user: buffer_sync, __init__, its argument check
            )
    if forward_sync_buffers is not None:
        return BufferSync(at_init=True, in_forward=bool(forward_sync_buffers))
    effective = True if broadcast_buffers is None else bool(broadcast_buffers)
    return BufferSync(at_init=effective, in_forward=effective)


def resolve_devices(
    device_ids: Sequence[int | torch.device] | None,
    output_device: int | torch.device | None,
    param_devices: set[torch.device],
) -> tuple[list[int] | None, int | None]:
    """``device_ids`` / ``output_device`` as torch accepts them: only for one-GPU modules.

    Returns:
        The device indices and the output device index, or ``(None, None)`` for a CPU or
        multi-device module (then inputs stay where they are).

    Raises:
        ValueError: more than one id; parameters on several device types; ids given for a CPU
            or multi-device module (seed 002's ``device_ids=[local_rank]`` on a CPU model).
    """
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError(
            f"DistributedDataParallel: device_ids={list(device_ids)}: device_ids can only be "
            f"None or contain a single element (launch one process per GPU)"
        )
    types = {d.type for d in param_devices}
    if len(types) != 1:
        raise ValueError(
            f"DistributedDataParallel's input module must be on the same type of devices, but "
            f"its parameters are on {sorted(types)}"
        )
    cpu_or_multi = types == {"cpu"} or len(param_devices) > 1
    if not device_ids or cpu_or_multi:
        if device_ids or output_device is not None:
            raise ValueError(
                f"DistributedDataParallel: device_ids={_shown(device_ids)} and "
                f"output_device={output_device!r} only work with a module on one GPU, but the "
                f"module's parameters are on {sorted(str(d) for d in param_devices)}; pass "
                f"neither for a CPU or multi-device module"
            )
        return None, None
    index = [_index(d) for d in device_ids]
    return index, _index(output_device if output_device is not None else device_ids[0])


def _shown(device_ids: Sequence[Any] | None) -> Any:
    return None if device_ids is None else list(device_ids)


def _index(device: int | torch.device | str) -> int:
    if isinstance(device, int):
        return device
    index = torch.device(device).index
    return 0 if index is None else index


def resolve_group(group: dist.ProcessGroup | None, device_mesh: Any) -> dist.ProcessGroup:
    """The process group from ``process_group`` or a 1-D ``device_mesh`` (default: the world)."""
    if group is not None and device_mesh is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
        return device_mesh.get_group(mesh_dim=0)
    world = dist.group.WORLD
    assert world is not None  # dist.is_initialized() was checked
    return group if group is not None else world


def refuse_uninitialized(named: Sequence[tuple[str, nn.Parameter]]) -> None:
    """A lazy module's parameters have no shape yet: torch refuses them too."""
    for name, p in named:
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise RuntimeError(
                f"DistributedDataParallel: parameter {name!r} is uninitialized (a lazy module): "
                f"run a dummy forward pass before wrapping the model"
            )


def sparse_parameter_names(module: nn.Module) -> set[str]:
    """Parameters with sparse gradients: ``Embedding`` / ``EmbeddingBag`` with ``sparse=True``."""
    names = set()
    for prefix, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse:
            own = sub.named_parameters(recurse=False)
            names |= {f"{prefix}.{n}" if prefix else n for n, _ in own}
    return names


def check_flags(delay_named: Any, delay_trigger: Any, check_reduction: bool) -> None:
    """The pairing of the delayed all-reduce arguments; the deprecated ``check_reduction``."""
    if (delay_named is None) != (delay_trigger is None):
        raise ValueError(
            "DistributedDataParallel: delay_all_reduce_named_params and "
            "param_to_hook_all_reduce need to be set at the same time, got "
            f"delay_all_reduce_named_params={delay_named!r} and "
            f"param_to_hook_all_reduce={delay_trigger!r}"
        )
    if check_reduction:
        warnings.warn(
            "The `check_reduction` argument in `DistributedDataParallel` module is deprecated "
            "and has no effect.",
            FutureWarning,
            stacklevel=4,  # the user: check_flags, __init__, its argument check
        )
