"""Messages over c10d point-to-point: a header tensor, then at most one payload tensor.

Headers, shard payloads and error texts travel on three tags, so a receiver always knows the
size of what it posts: a header is ``HEADER_LEN`` int64, and the header announces the payload.
Nothing is unpickled; see :mod:`.protocol`.

These calls go to ``torch.distributed`` directly rather than through phalanx's tracked
wrappers: a server receives from every worker on its own thread, and the wrappers' per-rank
sequence numbers describe collectives that all ranks issue in one order, which these messages
are not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from phalanx.parameter_server.protocol import (
    HEADER_LEN,
    Header,
    Kind,
    ProtocolError,
    decode_header,
)
from phalanx.parameter_server.shards import ShardPlan

__all__ = ["Message", "error_payload", "receive", "send"]

TAG_HEADER, TAG_SHARD, TAG_ERROR = 7301, 7302, 7303
MAX_ERROR_BYTES = 64 * 1024
"""Longest error text accepted; a larger announced size is refused before allocating."""


@dataclass(frozen=True)
class Message:
    """A received message: its header and its payload (None, a shard, or an error text)."""

    header: Header
    payload: torch.Tensor | None = None

    @property
    def text(self) -> str:
        """The UTF-8 text of an ERROR message."""
        assert self.payload is not None
        return bytes(self.payload.tolist()).decode("utf-8", "replace")


def _group_peer(peer: int, group: dist.ProcessGroup) -> int:
    return dist.get_global_rank(group, peer)


def send(
    header: torch.Tensor,
    dst: int,
    group: dist.ProcessGroup,
    payload: torch.Tensor | None = None,
    *,
    wait: bool = True,
) -> list[Any]:
    """Send ``header`` (and ``payload``) to group rank ``dst``.

    With ``wait=False`` the sends are only posted; the caller keeps the returned works (and
    must not modify ``payload``) until ``work.wait()`` returns: gloo reads the memory when the
    receiver is ready, not when the send is posted.
    """
    peer = _group_peer(dst, group)
    works: list[Any] = [dist.isend(header, peer, group=group, tag=TAG_HEADER)]
    if payload is not None:
        kind = Kind(int(header[1]))
        tag = TAG_ERROR if kind is Kind.ERROR else TAG_SHARD
        works.append(dist.isend(payload, peer, group=group, tag=tag))
    if wait:
        for work in works:
            work.wait()
        return []
    return works


def error_payload(text: str, device: torch.device | None = None) -> torch.Tensor:
    """``text`` as the uint8 payload of an ERROR message."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.uint8, device=device)


def receive(
    src: int,
    group: dist.ProcessGroup,
    plan: ShardPlan | None = None,
    device: torch.device | None = None,
) -> Message:
    """Receive one message from group rank ``src``; the header is validated before the payload.

    Raises:
        ProtocolError: for a header that does not decode (the stream cannot be trusted after).
        RuntimeError: from the backend when the peer is gone or the group's timeout passes.
    """
    peer = _group_peer(src, group)
    raw = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
    dist.recv(raw, peer, group=group, tag=TAG_HEADER)
    header = decode_header(raw.cpu(), plan)
    if header.dtype is None:
        return Message(header)
    if header.kind is Kind.ERROR and header.numel > MAX_ERROR_BYTES:
        raise ProtocolError(
            f"bad message header: field 'numel' = {header.numel}: an error text is at most "
            f"{MAX_ERROR_BYTES} bytes"
        )
    payload = torch.empty(header.numel, dtype=header.dtype, device=device)
    tag = TAG_ERROR if header.kind is Kind.ERROR else TAG_SHARD
    dist.recv(payload, peer, group=group, tag=tag)
    return Message(header, payload)
