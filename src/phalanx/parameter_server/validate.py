"""Check a worker's PUSH before the server touches its state.

One bad update poisons every worker that pulls afterwards: a NaN in a gradient becomes a NaN in
every parameter of the shard after the optimizer step, and no later update can remove it. So the
server refuses the update whole, before applying anything, and says which worker sent it.
"""

from __future__ import annotations

import torch

from phalanx.parameter_server.protocol import Header, Kind
from phalanx.parameter_server.shards import ShardPlan

__all__ = ["MalformedUpdate", "check_update"]


class MalformedUpdate(ValueError):
    """A PUSH the server must not apply; the message names the worker, the shard and why."""


def _fail(header: Header, problem: str) -> MalformedUpdate:
    return MalformedUpdate(
        f"refused update from worker {header.worker} for shard {header.shard} "
        f"(step {header.step}): {problem}"
    )


def _check_layout(header: Header, payload: torch.Tensor, plan: ShardPlan) -> None:
    if header.kind is not Kind.PUSH:
        raise _fail(header, f"message kind is {header.kind.name}, not PUSH")
    if not 0 <= header.shard < plan.num_servers:
        raise _fail(header, f"the shard plan has {plan.num_servers} shards")
    expected = plan.numel(header.shard)
    if payload.dim() != 1 or payload.numel() != expected:
        raise _fail(
            header,
            f"payload has shape {tuple(payload.shape)}, the shard is 1-D with {expected} elements",
        )
    if header.numel != expected:
        raise _fail(header, f"header says numel {header.numel}, the shard has {expected}")


def _check_dtype(header: Header, payload: torch.Tensor, dtype: torch.dtype | None) -> None:
    if payload.dtype != header.dtype:
        raise _fail(header, f"payload dtype {payload.dtype}, the header says {header.dtype}")
    if not payload.dtype.is_floating_point:
        raise _fail(header, f"payload dtype {payload.dtype} is not floating point")
    if dtype is not None and payload.dtype != dtype:
        raise _fail(header, f"payload dtype {payload.dtype}, the server holds {dtype}")


def _check_finite(header: Header, payload: torch.Tensor, plan: ShardPlan) -> None:
    finite = torch.isfinite(payload)
    if bool(finite.all()):
        return
    nan = int(torch.isnan(payload).sum())
    bad = int((~finite).sum())
    where = [
        f"{s.name!r} ({int((~finite[s.offset : s.offset + s.numel]).sum())})"
        for s in plan.slots(header.shard)
        if not bool(finite[s.offset : s.offset + s.numel].all())
    ]
    raise _fail(
        header,
        f"{bad} of {payload.numel()} elements are not finite ({nan} NaN, {bad - nan} Inf) in "
        f"tensor {', '.join(where)}",
    )


def check_update(
    header: Header,
    payload: torch.Tensor,
    plan: ShardPlan,
    *,
    dtype: torch.dtype | None = None,
) -> None:
    """Raise unless ``payload`` is a well-formed, finite update for ``header.shard``.

    Args:
        header: The decoded PUSH header.
        payload: The received flat update (any device).
        plan: The shard plan the server was built from.
        dtype: The dtype of the server's shard, when it must match exactly.

    Raises:
        MalformedUpdate: naming the worker, the shard and the problem: wrong kind, shard out of
            range, wrong numel / shape, wrong dtype, or NaN / Inf (with the count of bad
            elements).
    """
    _check_layout(header, payload, plan)
    _check_dtype(header, payload, dtype)
    _check_finite(header, payload, plan)
