"""The parameter server's fixed-layout message header: an int64 tensor, never a pickle.

Every message is a header tensor sent with c10d point-to-point, optionally followed by one
payload tensor whose element count and dtype the header announces, so the receiver can allocate
it before ``irecv``. Nothing on the wire is unpickled: a peer can only send numbers, and
:func:`decode_header` checks each of them before the server acts on it.

Layout (``HEADER_LEN`` = 9 int64 elements):

=====  ===========  =================================================================
index  field        meaning
=====  ===========  =================================================================
0      magic        ``MAGIC``: ``0x50484C58`` ("PHLX") << 16 | ``PROTOCOL_VERSION``
1      kind         :class:`Kind`: PULL_REQUEST, PARAMS, PUSH, ACK, HEARTBEAT, STOP, ERROR
2      worker       worker index (sender of a request, or addressee of a reply), >= 0
3      step         the worker's step (clock) the message belongs to, >= 0
4      version      parameter version: served (PARAMS) or pulled (PUSH), >= 0
5      shard        server / shard index, ``< plan.num_servers`` when a plan is given
6      numel        payload elements: the shard's for PARAMS / PUSH, bytes for ERROR, else 0
7      dtype        payload dtype code (``DTYPE_CODES``); 0 = no payload
8      flags        bit field, bits 0..15 (``FLAGS_MASK``); higher bits are rejected
=====  ===========  =================================================================

PARAMS and PUSH carry a floating-point shard; ERROR carries a UTF-8 message as uint8; the other
kinds carry nothing (numel 0, dtype 0).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from phalanx.parameter_server.shards import ShardPlan

__all__ = [
    "DTYPE_CODES",
    "HEADER_LEN",
    "MAGIC",
    "Header",
    "Kind",
    "ProtocolError",
    "decode_header",
    "encode_header",
]

PROTOCOL_VERSION = 1
MAGIC = (0x50484C58 << 16) | PROTOCOL_VERSION
HEADER_LEN = 9
FLAGS_MASK = 0xFFFF
FIELDS = ("magic", "kind", "worker", "step", "version", "shard", "numel", "dtype", "flags")

DTYPE_CODES: dict[int, torch.dtype] = {
    1: torch.float32,
    2: torch.float64,
    3: torch.float16,
    4: torch.bfloat16,
    5: torch.uint8,
}
"""Payload dtype per code; 0 means "no payload"."""
_CODE_OF = {d: c for c, d in DTYPE_CODES.items()}


class ProtocolError(ValueError):
    """A header that is not a valid phalanx parameter-server message; names field and value."""


class Kind(enum.IntEnum):
    """What a message is."""

    PULL_REQUEST = 1
    PARAMS = 2
    PUSH = 3
    ACK = 4
    HEARTBEAT = 5
    STOP = 6
    ERROR = 7


_SHARD_PAYLOAD = frozenset({Kind.PARAMS, Kind.PUSH})
_KINDS = frozenset(k.value for k in Kind)
_INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Header:
    """A decoded, validated message header."""

    kind: Kind
    worker: int
    step: int
    version: int
    shard: int
    numel: int
    dtype: torch.dtype | None
    """Payload dtype, ``None`` when the message has no payload."""
    flags: int = 0


def _bad(field: str, value: object, why: str) -> ProtocolError:
    return ProtocolError(f"bad message header: field {field!r} = {value!r}: {why}")


def _check_payload(kind: Kind, numel: int, code: int) -> None:
    if code != 0 and code not in DTYPE_CODES:
        raise _bad("dtype", code, f"unknown dtype code (known: 0 = none, {dict(DTYPE_CODES)})")
    dtype = DTYPE_CODES.get(code)
    if kind in _SHARD_PAYLOAD and (dtype is None or not dtype.is_floating_point):
        raise _bad("dtype", code, f"{kind.name} carries a floating-point shard")
    if kind is Kind.ERROR and dtype is not torch.uint8:
        raise _bad("dtype", code, "ERROR carries a uint8 (UTF-8) message, code 5")
    if kind not in _SHARD_PAYLOAD and kind is not Kind.ERROR and (numel != 0 or code != 0):
        raise _bad("numel" if numel else "dtype", numel or code, f"{kind.name} has no payload")


def _check_plan(kind: Kind, shard: int, numel: int, plan: ShardPlan) -> None:
    if shard >= plan.num_servers:
        raise _bad("shard", shard, f"the shard plan has {plan.num_servers} servers")
    if kind in _SHARD_PAYLOAD and numel != plan.numel(shard):
        raise _bad("numel", numel, f"the shard plan says shard {shard} has {plan.numel(shard)}")


def _validate(values: list[int], plan: ShardPlan | None) -> Header:
    if values[0] != MAGIC:
        raise _bad("magic", values[0], f"expected {MAGIC} (protocol version {PROTOCOL_VERSION})")
    for field, value in zip(FIELDS[1:], values[1:]):
        if value < 0:
            raise _bad(field, value, "must be >= 0")
    if values[1] not in _KINDS:
        raise _bad("kind", values[1], f"unknown kind (known: {[k.value for k in Kind]})")
    kind = Kind(values[1])
    worker, step, version, shard, numel, code, flags = values[2:]
    if flags & ~FLAGS_MASK:
        raise _bad("flags", flags, f"bits outside {FLAGS_MASK:#x} are not defined")
    _check_payload(kind, numel, code)
    if plan is not None:
        _check_plan(kind, shard, numel, plan)
    return Header(kind, worker, step, version, shard, numel, DTYPE_CODES.get(code), flags)


def decode_header(t: torch.Tensor, plan: ShardPlan | None = None) -> Header:
    """Decode and validate a received header tensor.

    Args:
        t: The received int64 tensor of ``HEADER_LEN`` elements (any device).
        plan: When given, ``shard`` must name one of its servers and a PARAMS / PUSH payload
            must have exactly that shard's element count.

    Raises:
        ProtocolError: naming the offending field and its value (wrong magic, unknown kind,
            negative field, numel not matching the plan, unknown dtype code, ...).
    """
    if not isinstance(t, torch.Tensor):
        raise ProtocolError(f"bad message header: expected a tensor, got {type(t).__name__}")
    if t.dtype != torch.int64 or tuple(t.shape) != (HEADER_LEN,):
        raise ProtocolError(
            f"bad message header: expected int64 of shape ({HEADER_LEN},), "
            f"got {t.dtype} of shape {tuple(t.shape)}"
        )
    return _validate([int(v) for v in t.tolist()], plan)


def encode_header(
    kind: Kind,
    *,
    worker: int,
    step: int = 0,
    version: int = 0,
    shard: int = 0,
    numel: int = 0,
    dtype: torch.dtype | None = None,
    flags: int = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Build a header tensor; the same checks as :func:`decode_header` (without a plan) apply.

    Args:
        kind: The message kind.
        worker: Worker index (sender of a request, addressee of a reply).
        step: The worker's step / clock.
        version: Parameter version served (PARAMS) or pulled (PUSH).
        shard: Server / shard index.
        numel: Payload elements (0 without a payload).
        dtype: Payload dtype (``None`` without a payload).
        flags: Bits 0..15.
        device: Where to build the tensor (NCCL needs it on the GPU).

    Raises:
        ProtocolError: naming the field that would not decode.
    """
    if dtype is not None and dtype not in _CODE_OF:
        raise _bad("dtype", dtype, f"not sendable (sendable: {list(_CODE_OF)})")
    code = 0 if dtype is None else _CODE_OF[dtype]
    values = [MAGIC, int(kind), worker, step, version, shard, numel, code, flags]
    for field, value in zip(FIELDS, values):
        if value > _INT64_MAX:
            raise _bad(field, value, "does not fit in int64")
    _validate(values, None)
    return torch.tensor(values, dtype=torch.int64, device=device)
