"""Parameter-server wire header: round trips, and every malformed field is named."""

from __future__ import annotations

import pytest
import torch

from phalanx.parameter_server import (
    Header,
    Kind,
    ProtocolError,
    decode_header,
    encode_header,
    plan_shards,
)
from phalanx.parameter_server.protocol import DTYPE_CODES, FIELDS, HEADER_LEN, MAGIC

PLAN = plan_shards([("w", 6), ("b", 2), ("v", 3)], 2)  # shard 0: w (6); shard 1: b, v (5)


def _raw(**fields: int) -> torch.Tensor:
    """A PUSH header for shard 1 of PLAN, with ``fields`` overwritten (bypassing encode)."""
    t = encode_header(Kind.PUSH, worker=3, step=7, version=2, shard=1, numel=5, dtype=torch.float32)
    for name, value in fields.items():
        t[FIELDS.index(name)] = value
    return t


def test_round_trip_every_kind() -> None:
    payloads = {
        Kind.PARAMS: (6, torch.bfloat16),
        Kind.PUSH: (6, torch.float64),
        Kind.ERROR: (11, torch.uint8),
    }
    for kind in Kind:
        numel, dtype = payloads.get(kind, (0, None))
        t = encode_header(
            kind, worker=4, step=9, version=8, shard=0, numel=numel, dtype=dtype, flags=0x8001
        )
        assert t.dtype == torch.int64 and tuple(t.shape) == (HEADER_LEN,)
        assert int(t[0]) == MAGIC
        assert decode_header(t, PLAN if kind is not Kind.ERROR else None) == Header(
            kind, 4, 9, 8, 0, numel, dtype, 0x8001
        )


def test_round_trip_large_values_and_every_float_dtype() -> None:
    big = 2**62 + 12345  # int64 must carry it exactly (float32 or float64 would round it)
    for dtype in (d for d in DTYPE_CODES.values() if d.is_floating_point):
        h = decode_header(
            encode_header(Kind.PUSH, worker=big, step=big, version=big, numel=6, dtype=dtype)
        )
        assert (h.worker, h.step, h.version, h.dtype) == (big, big, big, dtype)


def test_decode_checks_the_plan() -> None:
    assert decode_header(_raw(), PLAN).numel == 5
    with pytest.raises(ProtocolError, match=r"'numel' = 6: .*shard 1 has 5"):
        decode_header(_raw(numel=6), PLAN)
    with pytest.raises(ProtocolError, match=r"'shard' = 2: the shard plan has 2 servers"):
        decode_header(_raw(shard=2), PLAN)
    # without a plan there is nothing to compare numel with
    assert decode_header(_raw(numel=6)).numel == 6


@pytest.mark.parametrize(
    ("fields", "pattern"),
    [
        ({"magic": 12345}, r"'magic' = 12345: expected"),
        ({"magic": MAGIC + 1}, r"'magic' = .*protocol version 1"),
        ({"kind": 0}, r"'kind' = 0: unknown kind"),
        ({"kind": 99}, r"'kind' = 99: unknown kind"),
        ({"kind": -1}, r"'kind' = -1: must be >= 0"),
        ({"worker": -3}, r"'worker' = -3: must be >= 0"),
        ({"step": -1}, r"'step' = -1: must be >= 0"),
        ({"version": -2}, r"'version' = -2: must be >= 0"),
        ({"shard": -1}, r"'shard' = -1: must be >= 0"),
        ({"numel": -5}, r"'numel' = -5: must be >= 0"),
        ({"dtype": -1}, r"'dtype' = -1: must be >= 0"),
        ({"flags": -1}, r"'flags' = -1: must be >= 0"),
        ({"flags": 1 << 16}, r"'flags' = 65536: bits outside 0xffff"),
        ({"dtype": 42}, r"'dtype' = 42: unknown dtype code"),
        ({"dtype": 0}, r"'dtype' = 0: PUSH carries a floating-point shard"),
        ({"dtype": 5}, r"'dtype' = 5: PUSH carries a floating-point shard"),
        ({"kind": int(Kind.ACK)}, r"'numel' = 5: ACK has no payload"),
        ({"kind": int(Kind.HEARTBEAT), "numel": 0}, r"'dtype' = 1: HEARTBEAT has no payload"),
        ({"kind": int(Kind.ERROR)}, r"'dtype' = 1: ERROR carries a uint8"),
    ],
)
def test_every_bad_field_is_named(fields: dict[str, int], pattern: str) -> None:
    with pytest.raises(ProtocolError, match=pattern):
        decode_header(_raw(**fields), PLAN)


def test_bad_tensor_and_protocol_error_is_value_error() -> None:
    with pytest.raises(ProtocolError, match=r"int64 of shape \(9,\), got torch.int32"):
        decode_header(_raw().to(torch.int32))
    with pytest.raises(ProtocolError, match=r"got torch.int64 of shape \(8,\)"):
        decode_header(_raw()[:8])
    with pytest.raises(ProtocolError, match="expected a tensor, got list"):
        decode_header([MAGIC] * 9)  # type: ignore[arg-type]
    assert issubclass(ProtocolError, ValueError)


def test_encode_refuses_what_would_not_decode() -> None:
    with pytest.raises(ProtocolError, match=r"'worker' = -1"):
        encode_header(Kind.PULL_REQUEST, worker=-1)
    with pytest.raises(ProtocolError, match=r"'step' = 9223372036854775808: does not fit"):
        encode_header(Kind.PULL_REQUEST, worker=0, step=2**63)
    with pytest.raises(ProtocolError, match=r"'dtype' = torch.complex64: not sendable"):
        encode_header(Kind.PUSH, worker=0, numel=4, dtype=torch.complex64)
    with pytest.raises(ProtocolError, match=r"'numel' = 4: STOP has no payload"):
        encode_header(Kind.STOP, worker=0, numel=4)
    with pytest.raises(ProtocolError, match=r"'kind' = 8: unknown kind"):
        encode_header(8, worker=0)  # type: ignore[arg-type]


def test_header_is_frozen() -> None:
    h = decode_header(_raw())
    with pytest.raises(AttributeError):
        h.step = 3  # type: ignore[misc]
