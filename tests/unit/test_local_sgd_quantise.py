"""The outer-gradient codec: fp32 / bf16 / int8 / int4 with per-block scales."""

from __future__ import annotations

import pytest
import torch

from phalanx.local_sgd.quantise import (
    decode,
    dequantise,
    encode,
    encoded_bytes,
    error_bound,
    quantise,
)


def _x(n: int = 1000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Magnitudes from 1e-6 to 10 along the tensor: per-block scales must follow them.
    return torch.randn(n, generator=g) * torch.logspace(-6, 1, n)


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("n", [1, 7, 256, 1000])
def test_round_trip_stays_within_the_bound(codec: str, n: int) -> None:
    x = _x(n)
    back = decode(encode(x, codec, block=64), codec, n, block=64)
    assert back.dtype == torch.float32 and back.shape == (n,)
    err = (back - x).abs()
    assert bool((err <= error_bound(x, codec, block=64)).all()), codec
    if codec == "fp32":
        assert torch.equal(back, x)


def test_int8_error_is_at_most_half_a_step_of_each_block() -> None:
    x = _x(4096, seed=1)
    values, scales = quantise(x, "int8", block=128)
    back = dequantise(values, scales, "int8", x.numel(), block=128)
    per_block_max = x.abs().view(-1, 128).amax(dim=1)
    err = (back - x).abs().view(-1, 128).amax(dim=1)
    # |x - q·s| <= s/2 = max|x| / 254 per block (plus float rounding of the product).
    assert bool((err <= per_block_max / 254 * (1 + 1e-6)).all())
    # ... and relative to the block's largest value, under 0.4%.
    assert float((err / per_block_max).max()) < 0.004
    # The quantisation is not trivially exact: the error is there, and bounded.
    assert float(err.max()) > 0


def test_int4_packs_two_values_per_byte_and_keeps_the_sign() -> None:
    x = torch.tensor([-7.0, 7.0, 0.0, -1.0, 3.0])
    values, scales = quantise(x, "int4", block=8)
    assert values.dtype == torch.uint8 and values.numel() == 3
    assert torch.equal(scales, torch.tensor([1.0]))
    assert torch.equal(dequantise(values, scales, "int4", 5, block=8), x)


def test_a_zero_block_comes_back_zero() -> None:
    x = torch.zeros(10)
    for codec in ("int8", "int4"):
        assert torch.equal(decode(encode(x, codec, 4), codec, 10, 4), x)


@pytest.mark.parametrize(
    ("codec", "numel", "block", "expected"),
    [("fp32", 10, 4, 40), ("bf16", 10, 4, 20), ("int8", 10, 4, 10 + 3 * 4), ("int4", 9, 4, 5 + 12)],
)
def test_encoded_bytes(codec: str, numel: int, block: int, expected: int) -> None:
    assert encoded_bytes(numel, codec, block) == expected
    assert encode(torch.ones(numel), codec, block).numel() == expected


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match=r"quantise\(codec='int2'\)"):
        quantise(torch.ones(3), "int2")
    with pytest.raises(ValueError, match=r"quantise\(block=0\)"):
        quantise(torch.ones(3), "int8", 0)
    with pytest.raises(ValueError, match="decode: 5 bytes do not hold 3 elements in int8"):
        decode(torch.zeros(5, dtype=torch.uint8), "int8", 3, 256)
