"""10,000 fuzzed frames into the parameter server's parsers: only their own errors come out."""

from __future__ import annotations

import random

import torch

from phalanx.parameter_server import (
    Kind,
    MalformedUpdate,
    ProtocolError,
    check_update,
    decode_header,
    encode_header,
    plan_shards,
)
from phalanx.parameter_server.protocol import HEADER_LEN

PLAN = plan_shards([("w", 6), ("b", 2), ("v", 3)], 2)
EXTREMES = [0, 1, -1, 2**63 - 1, -(2**63), 2**31, 7, 65535, 65536]


def _frame(rng: random.Random) -> torch.Tensor:
    """A valid PUSH header with a few fields mutated, or raw noise of a random shape/dtype."""
    if rng.random() < 0.2:
        n = rng.choice([0, 1, HEADER_LEN - 1, HEADER_LEN, HEADER_LEN + 1, 64])
        dtype = rng.choice([torch.int64, torch.int32, torch.float32, torch.uint8])
        return torch.randint(-100, 100, (n,)).to(dtype)
    shard = rng.randrange(2)
    t = encode_header(
        Kind.PUSH,
        worker=1,
        step=3,
        version=2,
        shard=shard,
        numel=PLAN.numel(shard),
        dtype=torch.float32,
    )
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(HEADER_LEN)
        t[i] = rng.choice(EXTREMES) if rng.random() < 0.5 else rng.randrange(-(2**40), 2**40)
    return t


def test_ten_thousand_fuzzed_headers_raise_only_protocol_errors() -> None:
    rng = random.Random(0)
    accepted = rejected = 0
    for _ in range(10_000):
        frame = _frame(rng)
        try:
            header = decode_header(frame, PLAN)
        except ProtocolError:
            rejected += 1
            continue
        accepted += 1
        # Whatever decodes is internally consistent: a shard payload the plan can hold.
        assert header.numel in (0, PLAN.numel(0), PLAN.numel(1)) or header.kind is Kind.ERROR
        assert 0 <= header.shard < PLAN.num_servers
    assert rejected > 5_000 and accepted > 100  # the fuzzer exercises both paths


def test_ten_thousand_fuzzed_updates_raise_only_malformed_update() -> None:
    rng = random.Random(1)
    for _ in range(10_000):
        shard = rng.randrange(2)
        header = decode_header(
            encode_header(
                Kind.PUSH, worker=0, shard=shard, numel=PLAN.numel(shard), dtype=torch.float32
            ),
            PLAN,
        )
        n = rng.choice([0, PLAN.numel(shard), PLAN.numel(shard) + 1, 11])
        payload = torch.randn(n) * rng.choice([1.0, 1e38, 1e39])
        if n and rng.random() < 0.3:
            payload[rng.randrange(n)] = rng.choice([float("nan"), float("inf")])
        if rng.random() < 0.2:
            payload = payload.to(rng.choice([torch.float64, torch.float16, torch.int32]))
        try:
            check_update(header, payload, PLAN, dtype=torch.float32)
        except MalformedUpdate:
            continue
        assert payload.dtype == torch.float32 and bool(torch.isfinite(payload).all())
