"""Point-to-point transport between pipeline stages: the shape header and tagged sends.

The user never declares shapes. Before the first activation of a step on a boundary the sender
sends a small int64 header (:func:`encode_header`: number of tensors, then per tensor dtype
code, requires-grad flag, ndim and dims), then one message per tensor per micro-batch.
Micro-batches of a step share shapes, so later ones carry no header; gradients flow back only
for tensors that require grad and have the activations' shapes, so they need none either.
Non-floating tensors (token ids passed along) carry no gradient.

Every message has its own tag (boundary, direction, micro-batch), so gloo matches each receive
with its send whatever order they are posted in. Eagerly (gloo), a receiver that knows the last
step's shapes posts the first activation's receive before the header arrives; a sender whose
shapes changed then satisfies that receive with a dummy of the old shapes and sends the real
activation under the ``FRESH`` tag, so the common case costs no header round trip.
:class:`Comm` posts messages eagerly (gloo) or in ``batch_isend_irecv`` groups (NCCL); the
ports of :mod:`.ports` decide what to send when.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from phalanx.comm import wait_clock
from phalanx.comm.p2p import batch_isend_irecv, irecv, isend
from phalanx.comm.work import TrackedWork

__all__ = [
    "DTYPES",
    "FRESH",
    "HEADER",
    "HEADER_CAP",
    "Comm",
    "TensorMeta",
    "decode_header",
    "encode_header",
]

HEADER, FRESH = -1, -2
"""Tag slots of the header and of a step's first activation when its shapes changed."""
HEADER_CAP = 32
"""int64 slots of the first header message; a longer header follows in a second message."""
DTYPES = (  # dtype codes of the header
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to allocate one tensor of a stage's output."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


def meta_of(t: torch.Tensor) -> TensorMeta:
    """The :class:`TensorMeta` of ``t``."""
    return TensorMeta(tuple(t.shape), t.dtype, t.requires_grad)


def encode_header(tensors: Sequence[torch.Tensor]) -> list[int]:
    """``[length, n, (dtype code, requires_grad, ndim, *dims) per tensor]`` as ints."""
    body = [len(tensors)]
    for t in tensors:
        if t.dtype not in DTYPES:
            raise TypeError(f"pipeline: cannot send a stage output of dtype {t.dtype}")
        body += [DTYPES.index(t.dtype), int(t.requires_grad), t.dim(), *t.shape]
    return [len(body) + 1, *body]


def decode_header(values: Sequence[int]) -> list[TensorMeta]:
    """Inverse of :func:`encode_header`."""
    metas, i = [], 2
    for _ in range(values[1]):
        dtype, grad, ndim = DTYPES[values[i]], bool(values[i + 1]), values[i + 2]
        metas.append(TensorMeta(tuple(values[i + 3 : i + 3 + ndim]), dtype, grad))
        i += 3 + ndim
    return metas


class _Handle:
    """A send or receive, posted now (eager) or at the next :meth:`Comm.flush` (grouped)."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.work: TrackedWork | None = None

    def wait(self) -> None:
        if self.work is None:
            self.comm.flush()  # a queued receive: post the group it belongs to
        assert self.work is not None
        with wait_clock.blocked():
            self.work.wait()


class Comm:
    """Tagged sends and receives to group ranks of ``group``; owns the step's outstanding sends.

    ``grouped=False`` posts every operation at once as isend/irecv (gloo: its background
    threads move data while this rank computes). ``grouped=True`` queues them and posts each
    batch with ``batch_isend_irecv`` when something must be waited for: one group holds the
    previous action's sends and the next action's receives, as Megatron-LM's
    ``send_forward_recv_backward`` does, so NCCL — which runs a rank pair's P2P kernels on one
    stream and needs both sides posted — cannot block a send behind a receive.
    """

    def __init__(
        self, group: dist.ProcessGroup | None, num_microbatches: int, grouped: bool = False
    ) -> None:
        self.group, self.grouped = group, grouped
        self.slots = num_microbatches + 2  # micro-batches, HEADER, FRESH
        self._pending: dict[tuple[int, int], list[tuple[_Handle, torch.Tensor]]] = {}
        self._queue: list[tuple[Any, torch.Tensor, int, int, _Handle]] = []
        self.trace: list[list[tuple[str, int, int]]] | None = None
        """Set to a list to record each posted group as ``(op, peer, tag)`` (diagnostics)."""

    def global_rank(self, group_rank: int) -> int:
        """Global rank of ``group_rank``: torch's P2P calls take global ranks."""
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def tag(self, boundary: int, backward: bool, slot: int) -> int:
        """Unique tag of a message: boundary, direction, micro-batch or ``HEADER``/``FRESH``."""
        return (2 * boundary + int(backward)) * self.slots + slot % self.slots

    def _post(self, op: Any, t: torch.Tensor, peer: int, tag: int) -> _Handle:
        handle = _Handle(self)
        self._queue.append((op, t, peer, tag, handle))
        if not self.grouped:
            self.flush()
        return handle

    def flush(self) -> None:
        """Post the queued operations (one ``batch_isend_irecv`` group when grouped)."""
        queue, self._queue = self._queue, []
        if not queue:
            return
        if self.trace is not None:
            self.trace.append(
                [
                    ("send" if op is dist.isend else "recv", peer, tag)
                    for op, _, peer, tag, _ in queue
                ]
            )
        if not self.grouped:
            op, t, peer, tag, handle = queue[0]
            call = isend if op is dist.isend else irecv
            handle.work = call(t, self.global_rank(peer), group=self.group, tag=tag)
            return
        ops = [
            dist.P2POp(op, t, self.global_rank(peer), self.group, tag)
            for op, t, peer, tag, _ in queue
        ]
        for (*_, handle), work in zip(queue, batch_isend_irecv(ops)):
            handle.work = work

    def send(self, t: torch.Tensor, peer: int, tag: int, key: tuple[int, int]) -> None:
        """Send ``t``; the tensor stays referenced until :meth:`wait_sends`."""
        t = t.detach().contiguous()
        self._pending.setdefault(key, []).append((self._post(dist.isend, t, peer, tag), t))

    def recv(self, buf: torch.Tensor, peer: int, tag: int) -> _Handle:
        """Receive into ``buf``; returns the handle to wait on."""
        return self._post(dist.irecv, buf, peer, tag)

    def wait_sends(self, key: tuple[int, int] | None = None) -> None:
        """Wait for the sends filed under ``key`` (all of them when None) and drop them."""
        keys = list(self._pending) if key is None else [key]
        for k in keys:
            for handle, _ in self._pending.pop(k, []):
                handle.wait()
