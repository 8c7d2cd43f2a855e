"""Messages over c10d point-to-point: a header tensor, then at most one payload tensor.

Headers, shard payloads and error texts travel on three tags, so a receiver always knows the
size of what it posts: a header is ``HEADER_LEN`` int64, and the header announces the payload.
Nothing is unpickled; see :mod:`.protocol`.

Authentication: with a job secret (``PHALANX_JOB_SECRET``, see :mod:`phalanx.comm.auth`) the
header travels with an HMAC-SHA256 of its bytes (4 more int64), checked *before* the header is
decoded, and a payload (sent as bytes) ends with an HMAC of header and payload bytes, checked
before the payload is returned. Without the secret a peer can make the receiver do nothing
but drop it.

The sends and receives are phalanx's tracked point-to-point calls (:mod:`phalanx.comm.p2p`):
each leaves a flight record on the ``p2p`` channel, apart from the collectives' sequence
numbers. A server's wait for a worker's next request is ``idle`` (it lasts as long as the worker
computes, or is silent between heartbeats), and so is a finished worker's wait for the final
parameters (they come when the last worker finishes); everything else, a worker's wait for its
server's reply to a pull included, is watched by the hang detector. A worker that stops
answering is the server's to find, by its heartbeats.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from phalanx.comm import p2p
from phalanx.comm.auth import MAC_BYTES, job_secret, mac, verify
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
MAC_WORDS = MAC_BYTES // 8
MAX_ERROR_BYTES = 64 * 1024
"""Longest error text accepted; a larger announced size is refused before allocating."""


class Unauthenticated(ProtocolError):
    """A message whose HMAC does not match the job secret."""


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())


@dataclass(frozen=True)
class Sent:
    """Posted sends and the tensors they read, which must live until :meth:`wait` returns."""

    works: list[Any]
    tensors: tuple[Any, ...]

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every send (each at most ``timeout`` seconds when given)."""
        for work in self.works:
            work.wait() if timeout is None else work.wait(timedelta(seconds=timeout))


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
) -> Sent:
    """Send ``header`` (and ``payload``) to group rank ``dst``.

    With ``wait=False`` the sends are only posted; the caller keeps the returned
    :class:`Sent` (and must not modify ``payload``) until its ``wait()`` returns: gloo reads
    the memory when the receiver is ready, not when the send is posted.
    """
    peer = _group_peer(dst, group)
    secret = job_secret()
    tag_words = torch.zeros(MAC_WORDS, dtype=torch.int64)
    if secret is not None:
        tag_words = torch.frombuffer(bytearray(mac(secret, _bytes(header))), dtype=torch.int64)
    framed = torch.cat([header.cpu(), tag_words])
    works: list[Any] = [p2p.isend(framed, peer, group=group, tag=TAG_HEADER)]
    keep = [framed]
    if payload is not None:
        kind = Kind(int(header[1]))
        tag = TAG_ERROR if kind is Kind.ERROR else TAG_SHARD
        body = payload.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        if secret is not None:  # the payload's HMAC rides at its end: no extra message
            tag_bytes = mac(secret, _bytes(header), _bytes(body))
            body = torch.cat([body, torch.frombuffer(bytearray(tag_bytes), dtype=torch.uint8)])
        keep.append(body)
        works.append(p2p.isend(body, peer, group=group, tag=tag))
    sent = Sent(works, (header, payload, *keep))
    if wait:
        sent.wait()
    return sent


def error_payload(text: str, device: torch.device | None = None) -> torch.Tensor:
    """``text`` as the uint8 payload of an ERROR message."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.uint8, device=device)


def receive(
    src: int,
    group: dist.ProcessGroup,
    plan: ShardPlan | None = None,
    device: torch.device | None = None,
    *,
    idle: bool = False,
) -> Message:
    """Receive one message from group rank ``src``; the header is validated before the payload.

    ``idle``: the wait for the header may be long by design (a server waiting for a worker's
    next request), so the hang detector never reports it; the payload follows its header and
    is always watched.

    Raises:
        ProtocolError: for a header that does not decode (the stream cannot be trusted after).
        CollectiveError: when the peer is gone or the group's timeout passes.
    """
    peer = _group_peer(src, group)
    framed = torch.empty(HEADER_LEN + MAC_WORDS, dtype=torch.int64)
    p2p.recv(framed, peer, group=group, tag=TAG_HEADER, idle=idle)
    raw, tag_words = framed[:HEADER_LEN], framed[HEADER_LEN:]
    secret = job_secret()
    if secret is not None and not verify(secret, _bytes(tag_words), _bytes(raw)):
        raise Unauthenticated(
            "message header failed authentication: its HMAC does not match this job's secret "
            "(a process outside the job, or a worker started without PHALANX_JOB_SECRET)"
        )
    header = decode_header(raw, plan)
    if header.dtype is None:
        return Message(header)
    if header.kind is Kind.ERROR and header.numel > MAX_ERROR_BYTES:
        raise ProtocolError(
            f"bad message header: field 'numel' = {header.numel}: an error text is at most "
            f"{MAX_ERROR_BYTES} bytes"
        )
    size = header.numel * header.dtype.itemsize
    body = torch.empty(size + (MAC_BYTES if secret is not None else 0), dtype=torch.uint8)
    tag = TAG_ERROR if header.kind is Kind.ERROR else TAG_SHARD
    p2p.recv(body, peer, group=group, tag=tag)
    if secret is not None and not verify(
        secret, _bytes(body[size:]), _bytes(raw), _bytes(body[:size])
    ):
        raise Unauthenticated(
            f"{header.kind.name} payload from group rank {src} failed authentication: its "
            f"HMAC does not match this job's secret"
        )
    payload = body[:size].view(header.dtype)
    return Message(header, payload if device is None else payload.to(device))
