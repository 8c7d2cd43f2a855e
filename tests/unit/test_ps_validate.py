"""Parameter-server update check: bad pushes refused, naming worker, shard and problem."""

from __future__ import annotations

import pytest
import torch

from phalanx.parameter_server import (
    Header,
    Kind,
    MalformedUpdate,
    check_update,
    decode_header,
    encode_header,
    plan_shards,
)

PLAN = plan_shards([("w", 6), ("b", 2), ("v", 3)], 2)  # shard 0: 6 elements; shard 1: 5


def _push(shard: int = 1, numel: int = 5, dtype: torch.dtype = torch.float32) -> Header:
    t = encode_header(Kind.PUSH, worker=3, step=7, shard=shard, numel=numel, dtype=dtype)
    return decode_header(t)


def test_good_update_passes() -> None:
    check_update(_push(), torch.randn(5), PLAN)
    check_update(_push(0, 6, torch.bfloat16), torch.zeros(6, dtype=torch.bfloat16), PLAN)
    check_update(_push(), torch.randn(5), PLAN, dtype=torch.float32)


@pytest.mark.parametrize(
    ("header", "payload", "pattern"),
    [
        (_push(), torch.zeros(4), r"payload has shape \(4,\), the shard is 1-D with 5 elements"),
        (_push(), torch.zeros(5, 1), r"payload has shape \(5, 1\)"),
        (_push(numel=6), torch.zeros(5), "header says numel 6, the shard has 5"),
        (_push(), torch.zeros(5, dtype=torch.float64), "payload dtype torch.float64, the header"),
        (_push(shard=2), torch.zeros(5), "the shard plan has 2 shards"),
        (
            decode_header(encode_header(Kind.ACK, worker=3, step=7, shard=1)),
            torch.zeros(5),
            "message kind is ACK, not PUSH",
        ),
        (
            Header(Kind.PUSH, 3, 7, 0, 1, 5, torch.int64),
            torch.zeros(5, dtype=torch.int64),
            "payload dtype torch.int64 is not floating point",
        ),
    ],
)
def test_malformed_updates_named(header: Header, payload: torch.Tensor, pattern: str) -> None:
    with pytest.raises(MalformedUpdate, match=r"update from worker 3 for shard \d+ \(step 7\)"):
        check_update(header, payload, PLAN)
    with pytest.raises(MalformedUpdate, match=pattern):
        check_update(header, payload, PLAN)


def test_server_dtype_must_match_when_given() -> None:
    with pytest.raises(MalformedUpdate, match=r"payload dtype torch\.float32, the server holds"):
        check_update(_push(), torch.zeros(5), PLAN, dtype=torch.float64)


def test_non_finite_elements_counted() -> None:
    payload = torch.tensor([1.0, float("nan"), float("inf"), float("-inf"), float("nan")])
    with pytest.raises(
        MalformedUpdate,
        match=r"worker 3 for shard 1 \(step 7\): 4 of 5 elements are not finite \(2 NaN, 2 Inf\)",
    ):
        check_update(_push(), payload, PLAN)
    half = torch.tensor([0.0, 0.0, 0.0, float("inf"), 0.0], dtype=torch.float16)
    with pytest.raises(MalformedUpdate, match=r"1 of 5 elements are not finite \(0 NaN, 1 Inf\)"):
        check_update(_push(dtype=torch.float16), half, PLAN)
    assert issubclass(MalformedUpdate, ValueError)
