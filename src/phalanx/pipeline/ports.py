"""The two ends of a pipeline boundary: what each stage sends and receives, and when.

A boundary joins virtual stage ``s`` (sender of activations, receiver of gradients) to ``s+1``.
Each side holds one port: :class:`Outbound` on ``s``, :class:`Inbound` on ``s+1``; when both
stages live on the same rank (one rank, several chunks) a :class:`Loopback` plays both parts.
Sends are never waited for mid-step until the peer has provably received them (its gradient
came back); gloo sends complete only once the receiver posts (a rendezvous), so waiting
earlier could deadlock 1F1B's traffic in both directions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from phalanx.pipeline.p2p import (
    FRESH,
    HEADER,
    HEADER_CAP,
    Comm,
    TensorMeta,
    decode_header,
    encode_header,
    meta_of,
)

__all__ = ["Inbound", "Loopback", "Outbound", "build_ports"]


@dataclass
class _Posted:
    bufs: list[torch.Tensor]
    works: list[Any]

    def wait(self) -> list[torch.Tensor]:
        for w in self.works:
            w.wait()
        return self.bufs


class Outbound:
    """Sender side of a boundary: activations out, gradients back in."""

    def __init__(self, comm: Comm, peer: int, boundary: int, device: torch.device) -> None:
        self.comm, self.peer, self.boundary, self.device = comm, peer, boundary, device
        self.metas: list[TensorMeta] | None = None
        self._sent: list[TensorMeta] | None = None  # the previous step's shapes
        self._grads: dict[int, _Posted] = {}

    def begin_step(self, early: bool = True) -> None:
        """Start a step: its first activation carries a header again."""
        self.metas, self._grads = None, {}

    def send(self, mb: int, outputs: Sequence[torch.Tensor]) -> None:
        """Send micro-batch ``mb``'s outputs (with the step's header if it is the first)."""
        metas = [meta_of(t) for t in outputs]
        if self.metas is None:
            self._send_first(mb, outputs, metas)
            return
        if metas != self.metas:
            raise ValueError(
                f"pipeline stage {self.boundary}: micro-batch {mb} output {metas} differs from "
                f"the step's first micro-batch {self.metas}; micro-batches must share shapes"
            )
        self._send_payload(mb, mb, outputs)

    def _send_payload(self, mb: int, slot: int, outputs: Sequence[torch.Tensor]) -> None:
        tag = self.comm.tag(self.boundary, False, slot)
        for t in outputs:
            self.comm.send(t, self.peer, tag, key=(self.boundary, mb))

    def _send_first(
        self, mb: int, outputs: Sequence[torch.Tensor], metas: list[TensorMeta]
    ) -> None:
        """The step's first activation and its header, matching what the receiver posted."""
        self.metas = metas
        if self.comm.grouped or self._sent is None:  # the receiver waits for the header first
            self._send_header(outputs)
            self._send_payload(mb, mb, outputs)
        else:  # the receiver has posted micro-batch 0 with the previous step's shapes
            assert mb == 0, "every schedule sends micro-batch 0 first"
            if metas == self._sent:
                self._send_payload(mb, mb, outputs)
            else:
                dummies = [
                    torch.zeros(m.shape, dtype=m.dtype, device=self.device) for m in self._sent
                ]
                self._send_payload(mb, mb, dummies)
                self._send_payload(mb, FRESH, outputs)
            self._send_header(outputs)
        self._sent = metas

    def _send_header(self, outputs: Sequence[torch.Tensor]) -> None:
        values = encode_header(outputs)
        tag = self.comm.tag(self.boundary, False, HEADER)
        head = torch.zeros(HEADER_CAP, dtype=torch.int64, device=self.device)
        head[: min(len(values), HEADER_CAP)] = torch.tensor(values[:HEADER_CAP])
        self.comm.send(head, self.peer, tag, key=(self.boundary, -1))
        if len(values) > HEADER_CAP:
            rest = torch.tensor(values[HEADER_CAP:], dtype=torch.int64, device=self.device)
            self.comm.send(rest, self.peer, tag, key=(self.boundary, -1))

    def post_grads(self, mb: int) -> None:
        """Post the receives of ``mb``'s gradients if this step's shapes are known."""
        if self.metas is None or mb in self._grads:
            return
        bufs = [
            torch.empty(m.shape, dtype=m.dtype, device=self.device)
            for m in self.metas
            if m.requires_grad
        ]
        tag = self.comm.tag(self.boundary, True, mb)
        self._grads[mb] = _Posted(bufs, [self.comm.recv(b, self.peer, tag) for b in bufs])

    def take_grads(self, mb: int) -> list[torch.Tensor]:
        """Gradients of ``mb``'s outputs that require grad, in output order (blocks)."""
        self.post_grads(mb)
        grads = self._grads.pop(mb).wait()
        # The peer used our activations before sending these: those sends are complete.
        self.comm.wait_sends((self.boundary, mb))
        return grads


class Inbound:
    """Receiver side of a boundary: activations in, gradients back out."""

    def __init__(self, comm: Comm, peer: int, boundary: int, device: torch.device) -> None:
        self.comm, self.peer, self.boundary, self.device = comm, peer, boundary, device
        self.metas: list[TensorMeta] | None = None
        self._cached: list[TensorMeta] | None = None  # the previous step's shapes
        self._head: _Posted | None = None
        self._acts: dict[int, _Posted] = {}
        self._speculated = False

    def begin_step(self, early: bool = True) -> None:
        """Start a step; with ``early``, post its header's receive, and micro-batch 0's with
        the previous step's shapes (the sender adapts if they changed; see :mod:`.p2p`)."""
        self.metas, self._acts, self._head = None, {}, None
        if early:
            self._post_header()
            if self._cached is not None:
                self._acts[0] = self._post_acts(0, self._cached)
                self._speculated = True

    def _post_acts(self, slot: int, metas: list[TensorMeta]) -> _Posted:
        bufs = [torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in metas]
        tag = self.comm.tag(self.boundary, False, slot)
        return _Posted(bufs, [self.comm.recv(b, self.peer, tag) for b in bufs])

    def _post_header(self) -> None:
        head = torch.zeros(HEADER_CAP, dtype=torch.int64, device=self.device)
        tag = self.comm.tag(self.boundary, False, HEADER)
        self._head = _Posted([head], [self.comm.recv(head, self.peer, tag)])

    def _wait_header(self) -> list[TensorMeta]:
        if self.metas is None:
            if self._head is None:
                self._post_header()
            assert self._head is not None
            values = self._head.wait()[0].tolist()
            if values[0] > HEADER_CAP:
                rest = torch.zeros(values[0] - HEADER_CAP, dtype=torch.int64, device=self.device)
                tag = self.comm.tag(self.boundary, False, HEADER)
                self.comm.recv(rest, self.peer, tag).wait()
                values += rest.tolist()
            self.metas = decode_header(values)
            if self._speculated and self.metas != self._cached:
                self._acts.pop(0).wait()  # the sender's dummy in the old shapes; the real one:
                self._acts[0] = self._post_acts(FRESH, self.metas)
            self._cached, self._speculated = self.metas, False
        return self.metas

    def post(self, mb: int, block: bool = False) -> None:
        """Post the receives of ``mb``'s activations (once the header is in, or if ``block``)."""
        if mb in self._acts or (self.metas is None and not block):
            return
        self._acts[mb] = self._post_acts(mb, self._wait_header())

    def take(self, mb: int) -> tuple[torch.Tensor, ...]:
        """``mb``'s activations as fresh leaves (requiring grad where the sender's did)."""
        self._wait_header()  # also settles a speculatively posted micro-batch 0
        self.post(mb, block=True)
        bufs = self._acts.pop(mb).wait()
        assert self.metas is not None
        return tuple(b.requires_grad_(m.requires_grad) for b, m in zip(bufs, self.metas))

    def send_grads(self, mb: int, inputs: Sequence[torch.Tensor]) -> None:
        """Send the gradients of ``mb``'s inputs that require grad (zeros where unused)."""
        tag = self.comm.tag(self.boundary, True, mb)
        for x in inputs:
            if x.requires_grad:
                g = x.grad if x.grad is not None else torch.zeros_like(x)
                self.comm.send(g, self.peer, tag, key=(self.boundary, -2))


class Loopback:
    """Both ports of a boundary whose two stages are chunks of the same rank: no messages."""

    def __init__(self) -> None:
        self._acts: dict[int, tuple[torch.Tensor, ...]] = {}
        self._grads: dict[int, list[torch.Tensor]] = {}

    def begin_step(self, early: bool = True) -> None:
        """Nothing carries over between steps."""
        self._acts, self._grads = {}, {}

    def send(self, mb: int, outputs: Sequence[torch.Tensor]) -> None:
        """Hand ``mb``'s outputs to the next chunk (detached: each chunk has its own graph)."""
        self._acts[mb] = tuple(t.detach().requires_grad_(t.requires_grad) for t in outputs)

    def post(self, mb: int, block: bool = False) -> None:
        """Nothing to post."""

    def post_grads(self, mb: int) -> None:
        """Nothing to post."""

    def take(self, mb: int) -> tuple[torch.Tensor, ...]:
        """The outputs :meth:`send` stored for ``mb``."""
        return self._acts.pop(mb)

    def send_grads(self, mb: int, inputs: Sequence[torch.Tensor]) -> None:
        """Store the gradients of ``mb``'s inputs that require grad."""
        self._grads[mb] = [
            x.grad if x.grad is not None else torch.zeros_like(x) for x in inputs if x.requires_grad
        ]

    def take_grads(self, mb: int) -> list[torch.Tensor]:
        """The gradients :meth:`send_grads` stored for ``mb``."""
        return self._grads.pop(mb)


def build_ports(
    comm: Comm, stage_ids: Sequence[int], num_stages: int, rank: int, device: torch.device
) -> tuple[list[Any], list[Any]]:
    """Per local stage: the port its input comes from and the port its output goes to.

    None for the first stage's input and the last stage's output. Virtual stage ``s`` lives on
    rank ``s % p``; a boundary between two chunks of this rank is a shared :class:`Loopback`.
    """
    p = num_stages // len(stage_ids)
    inbound: list[Any] = []
    outbound: list[Any] = []
    loops: dict[int, Loopback] = {}
    for s in stage_ids:
        if s == 0:
            inbound.append(None)
        elif (s - 1) % p == rank:
            inbound.append(loops.setdefault(s - 1, Loopback()))
        else:
            inbound.append(Inbound(comm, (s - 1) % p, s - 1, device))
        if s == num_stages - 1:
            outbound.append(None)
        elif (s + 1) % p == rank:
            outbound.append(loops.setdefault(s, Loopback()))
        else:
            outbound.append(Outbound(comm, (s + 1) % p, s, device))
    return inbound, outbound
