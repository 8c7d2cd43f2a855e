"""Where the parameters of a ZeRO-1/2 bucket live, and rank 0's values for them.

With ``parameters_as_bucket_view`` the parameters become views of one contiguous tensor per
bucket, in the bucket's order, so a rank's range of the bucket is one slice of it (the
all-gather then copies one slice per rank). Otherwise each parameter keeps its own storage, made
contiguous so that any range of it is a view.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from phalanx.comm import collectives as c
from phalanx.data_parallel.coalesce import copy_back, flatten
from phalanx.sharding.layout import BucketLayout

__all__ = ["broadcast_from_rank0", "place"]


def place(
    params: Sequence[torch.Tensor], bucket: BucketLayout, as_view: bool
) -> torch.Tensor | None:
    """Lay the bucket's parameters out; return the bucket's tensor when they become its views."""
    if not as_view:
        for i in bucket.params:
            p = params[i]
            if not p.is_contiguous():
                p.data = p.data.contiguous()
        return None
    p0 = params[bucket.params[0]]
    buf = torch.empty(bucket.numel, dtype=p0.dtype, device=p0.device)
    for index, off in zip(bucket.params, bucket.offsets):
        p = params[index]
        view = buf[off : off + p.numel()]
        view.copy_(p.detach().reshape(-1))
        p.data = view.view_as(p)
    return buf


def broadcast_from_rank0(
    params: Sequence[torch.Tensor],
    bucket: BucketLayout,
    buf: torch.Tensor | None,
    group: dist.ProcessGroup | None,
) -> None:
    """Give every rank the group's rank 0 values of the bucket's parameters (collective)."""
    root = dist.get_global_rank(group, 0) if group is not None else 0
    if buf is not None:
        c.broadcast(buf, root, group)
        return
    members = [params[i] for i in bucket.params]
    flat = flatten(members)
    c.broadcast(flat, root, group)
    copy_back(flat, members)
