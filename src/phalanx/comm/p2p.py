"""The seeds' point-to-point operations with torch's signatures: send / recv, isend / irecv, and
batches of ``P2POp``. Arguments are checked as the collectives' are; a backend failure becomes an
error naming this rank, the operation, the peer and what the peer must post.

Every operation leaves a flight record (op ``send`` / ``recv``, peer, shape, call site) on the
``p2p`` channel, apart from the collectives' sequence numbers and never lined up across ranks.
Its clock starts when this rank begins to *wait*: the call of a blocking ``send`` / ``recv``, or
``wait()`` on the handle of ``isend`` / ``irecv`` (a receive posted ahead of need is not a stuck
rank), and it closes when the wait returns (see :mod:`phalanx.comm.work`). The ring and tree
algorithms (:mod:`.algorithms`) send through the process group directly: their messages are
covered by the one record of the collective they implement.

Which waits may be long (the rule of the hang detector, ``PHALANX_HANG_TIMEOUT``):

- **Watched**: a wait on a named peer. A pipeline stage waiting for its neighbour's activations
  or gradients, a parameter-server worker waiting for its server's reply to a pull, a send that
  the receiver never takes: longer than the threshold is a hang, reported on every rank with
  the peer's stack.
- **Idle** (recorded, never reported): a receive from any rank (``src=None``: a server waiting
  for whichever worker speaks next), and a wait the caller marks ``idle=True`` because its
  length is the peer's business: a parameter server's per-worker request loop waits as long as
  that worker computes or is silent between heartbeats, and a worker that has finished waits
  for the final parameters until the last worker finishes. Liveness there is the heartbeats'
  job (a silent worker is declared lost), not the hang detector's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from phalanx._check import check_bool, check_instance
from phalanx.comm.collectives import Group, check_args
from phalanx.comm.errors import CollectiveError
from phalanx.comm.work import P2PEntry, TrackedWork, run_blocking

__all__ = ["batch_isend_irecv", "irecv", "isend", "recv", "send"]


def _failure(name: str, peer: int) -> Callable[[RuntimeError], Exception]:
    def make(exc: RuntimeError) -> Exception:
        me = dist.get_rank() if dist.is_initialized() else 0
        who = "any rank" if peer < 0 else f"peer rank {peer}"
        fix = "the sender is alive" if peer < 0 else f"rank {peer} is alive"
        return CollectiveError(
            f"[rank {me}] {name} with {who} failed: {str(exc).strip()[:300]}. Check that "
            f"{fix} and posts the matching {'recv' if 'send' in name else 'send'}."
        )

    return make


def _post(name: str, peer: int, call: Callable[[], Any]) -> Any:
    try:
        return call()
    except RuntimeError as exc:
        raise _failure(name, peer)(exc) from exc


def _entry(name: str, peer: int, tensor: torch.Tensor | None, idle: bool) -> P2PEntry:
    check_bool("idle", idle, where=name)
    op = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}.get(name, name)
    return P2PEntry(op, peer, tensor, idle, _failure(name, peer))


def send(
    tensor: torch.Tensor, dst: int, group: Group = None, tag: int = 0, *, idle: bool = False
) -> None:
    """Send ``tensor`` to global rank ``dst`` (blocking); ``idle``: see the module's rule."""
    check_args("send", group, tensor=tensor, dst=dst, tag=tag)
    entry = _entry("send", dst, tensor, idle)
    run_blocking(entry, lambda: dist.send(tensor, dst, group, tag))


def recv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: Group = None,
    tag: int = 0,
    *,
    idle: bool = False,
) -> int:
    """Receive into ``tensor`` from global rank ``src`` (any rank when None); return the sender.

    A receive from any rank, or one marked ``idle``, may wait as long as it takes without being
    reported as a hang (see the module's rule).
    """
    check_args("recv", group, tensor=tensor, tag=tag, **({} if src is None else {"src": src}))
    entry = _entry("recv", -1 if src is None else src, tensor, idle or src is None)
    return int(run_blocking(entry, lambda: dist.recv(tensor, src, group, tag)))


def isend(
    tensor: torch.Tensor, dst: int, group: Group = None, tag: int = 0, *, idle: bool = False
) -> TrackedWork:
    """Start sending ``tensor`` to ``dst``; returns a work handle with ``wait()``."""
    check_args("isend", group, tensor=tensor, dst=dst, tag=tag)
    entry = _entry("isend", dst, tensor, idle)
    return TrackedWork(_post("isend", dst, lambda: dist.isend(tensor, dst, group, tag)), entry)


def irecv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: Group = None,
    tag: int = 0,
    *,
    idle: bool = False,
) -> TrackedWork:
    """Start receiving into ``tensor`` from ``src``; returns a work handle with ``wait()``."""
    check_args("irecv", group, tensor=tensor, tag=tag, **({} if src is None else {"src": src}))
    peer = -1 if src is None else src
    entry = _entry("irecv", peer, tensor, idle or src is None)
    return TrackedWork(_post("irecv", peer, lambda: dist.irecv(tensor, src, group, tag)), entry)


def batch_isend_irecv(p2p_op_list: list[dist.P2POp]) -> list[TrackedWork]:
    """Start a batch of ``torch.distributed.P2POp`` sends and receives; returns their works.

    Each work is tracked as its operation's send or receive; a backend that coalesces the batch
    into fewer works (NCCL) gives each of them one record for the whole batch.
    """
    where = "batch_isend_irecv"
    check_instance("p2p_op_list", p2p_op_list, list, "a list of P2POp", where=where)
    for i, op in enumerate(p2p_op_list):
        check_instance(
            f"p2p_op_list[{i}]", op, dist.P2POp, "a torch.distributed.P2POp", where=where
        )
    works = list(_post(where, -1, lambda: dist.batch_isend_irecv(p2p_op_list)))
    if len(works) == len(p2p_op_list):
        names = ["isend" if op.op is dist.isend else "irecv" for op in p2p_op_list]
        return [
            TrackedWork(w, _entry(name, op.peer, op.tensor, False))
            for w, name, op in zip(works, names, p2p_op_list)
        ]
    peers = {op.peer for op in p2p_op_list}
    peer = peers.pop() if len(peers) == 1 else -1
    first = p2p_op_list[0].tensor if p2p_op_list else None
    return [TrackedWork(w, _entry("send/recv", peer, first, False)) for w in works]
