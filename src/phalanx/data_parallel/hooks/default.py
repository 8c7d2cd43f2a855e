"""Lossless and half-precision all-reduce hooks, with torch's ``default_hooks`` semantics.

Each hook follows the contract of :mod:`phalanx.data_parallel.grad_bucket` (and of torch's
``DistributedDataParallel.register_comm_hook``): ``state`` is the process group (None means the
default group), ``bucket.buffer()`` holds this rank's local gradients, and the returned future's
value is the group average in the buffer's shape and dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from phalanx.comm import collectives as c
from phalanx.data_parallel.grad_bucket import GradBucket

__all__ = ["allreduce_hook", "bf16_compress_hook", "fp16_compress_hook"]

Future = torch.futures.Future[torch.Tensor]
H = TypeVar("H", bound=Callable[..., Any])


def ddp_compatible(hook: H) -> H:
    """Give ``hook`` the runtime annotations torch's ``register_comm_hook`` insists on.

    torch's DDP refuses a hook whose ``bucket`` or return annotation is not *equal* to
    ``dist.GradBucket`` / ``Future[Tensor]``; under ``from __future__ import annotations`` they
    are strings, and statically they name phalanx's ``GradBucket`` (same interface).
    """
    hook.__annotations__ = {
        **hook.__annotations__,
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    return hook


@ddp_compatible
def allreduce_hook(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> Future:
    """Average the bucket over the group with one uncompressed all-reduce.

    Args:
        process_group: Group to average over; None for the default group.
        bucket: The bucket of local gradients.

    Returns:
        A future whose value is the averaged buffer (the same tensor, updated in place).
    """
    return allreduce_future(process_group, bucket.buffer())


def allreduce_future(group: dist.ProcessGroup | None, tensor: torch.Tensor) -> Future:
    """Start averaging ``tensor`` in place over ``group``; the future's value is ``tensor``."""
    # Divide before summing (not after) so the sum of N large gradients cannot overflow.
    tensor.div_(dist.get_world_size(group))
    work = c.all_reduce(tensor, dist.ReduceOp.SUM, group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


@ddp_compatible
def fp16_compress_hook(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> Future:
    """Average the bucket in float16: half the bytes of an fp32 all-reduce, ~3 decimal digits.

    The local gradients are divided by the group size *before* the cast, so the fp16 sum cannot
    exceed the largest local value (fp16 overflows at 65504). The result is cast back to the
    buffer's dtype in a ``then`` callback.

    Args:
        process_group: Group to average over; None for the default group.
        bucket: The bucket of local gradients.

    Returns:
        A future whose value is the averaged buffer in its original dtype.
    """
    return _half_precision_future(process_group, bucket.buffer(), torch.float16)


@ddp_compatible
def bf16_compress_hook(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> Future:
    """Average the bucket in bfloat16: half the bytes of fp32, fp32's range, ~2 decimal digits.

    Args:
        process_group: Group to average over; None for the default group.
        bucket: The bucket of local gradients.

    Returns:
        A future whose value is the averaged buffer in its original dtype.
    """
    return _half_precision_future(process_group, bucket.buffer(), torch.bfloat16)


# torch's DDP refuses any hook *named* bf16_compress_hook unless CUDA and NCCL >= 2.10 are present,
# though gloo reduces bfloat16 fine; a distinct name lets this one run on CPU too.
bf16_compress_hook.__name__ = "phalanx_bf16_compress_hook"


def _half_precision_future(
    group: dist.ProcessGroup | None, buffer: torch.Tensor, dtype: torch.dtype
) -> Future:
    compressed = buffer.div_(dist.get_world_size(group)).to(dtype)
    work = c.all_reduce(compressed, dist.ReduceOp.SUM, group, async_op=True)
    return work.get_future().then(_decompress_into(buffer))


def _decompress_into(buffer: torch.Tensor) -> Callable[[Future], torch.Tensor]:
    def decompress(fut: Future) -> torch.Tensor:
        return buffer.copy_(fut.value()[0])

    return decompress
