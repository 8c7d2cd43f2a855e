"""The seeds' point-to-point operations with torch's signatures: send / recv, isend / irecv, and
batches of ``P2POp``. Arguments are checked as the collectives' are; a backend failure becomes an
error naming this rank, the operation, the peer and what the peer must post.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from phalanx._check import check_instance
from phalanx.comm.collectives import Group, check_args
from phalanx.comm.errors import CollectiveError

__all__ = ["batch_isend_irecv", "irecv", "isend", "recv", "send"]


def _p2p(name: str, peer: int, call: Callable[[], Any]) -> Any:
    try:
        return call()
    except RuntimeError as exc:
        me = dist.get_rank() if dist.is_initialized() else 0
        raise CollectiveError(
            f"[rank {me}] {name} with peer rank {peer} failed: {str(exc).strip()[:300]}. "
            f"Check that rank {peer} is alive and posts the matching "
            f"{'recv' if 'send' in name else 'send'}."
        ) from exc


def send(tensor: torch.Tensor, dst: int, group: Group = None, tag: int = 0) -> None:
    """Send ``tensor`` to global rank ``dst`` (blocking)."""
    check_args("send", group, tensor=tensor, dst=dst, tag=tag)
    _p2p("send", dst, lambda: dist.send(tensor, dst, group, tag))


def recv(tensor: torch.Tensor, src: int | None = None, group: Group = None, tag: int = 0) -> int:
    """Receive into ``tensor`` from global rank ``src`` (any rank when None); return the sender."""
    check_args("recv", group, tensor=tensor, tag=tag, **({} if src is None else {"src": src}))
    peer = -1 if src is None else src
    return int(_p2p("recv", peer, lambda: dist.recv(tensor, src, group, tag)))


def isend(tensor: torch.Tensor, dst: int, group: Group = None, tag: int = 0) -> Any:
    """Start sending ``tensor`` to ``dst``; returns a work handle with ``wait()``."""
    check_args("isend", group, tensor=tensor, dst=dst, tag=tag)
    return _p2p("isend", dst, lambda: dist.isend(tensor, dst, group, tag))


def irecv(tensor: torch.Tensor, src: int | None = None, group: Group = None, tag: int = 0) -> Any:
    """Start receiving into ``tensor`` from ``src``; returns a work handle with ``wait()``."""
    check_args("irecv", group, tensor=tensor, tag=tag, **({} if src is None else {"src": src}))
    peer = -1 if src is None else src
    return _p2p("irecv", peer, lambda: dist.irecv(tensor, src, group, tag))


def batch_isend_irecv(p2p_op_list: list[dist.P2POp]) -> list[Any]:
    """Start a batch of ``torch.distributed.P2POp`` sends and receives; returns their works."""
    where = "batch_isend_irecv"
    check_instance("p2p_op_list", p2p_op_list, list, "a list of P2POp", where=where)
    for i, op in enumerate(p2p_op_list):
        check_instance(
            f"p2p_op_list[{i}]", op, dist.P2POp, "a torch.distributed.P2POp", where=where
        )
    return list(_p2p("batch_isend_irecv", -1, lambda: dist.batch_isend_irecv(p2p_op_list)))
