"""Outer gradients in fewer bits: fp32, bf16, or int8 / int4 with one scale per block.

Streaming DiLoCo (Douillard et al. 2025) sends its pseudo-gradients in 4 to 8 bits without
loss of quality. Integers use symmetric absmax quantisation per block of ``block`` elements:
``scale = max|x| / qmax`` (qmax 127 for int8, 7 for int4), ``q = round(x / scale)``, so each
element comes back within ``scale / 2`` of where it was (:func:`error_bound`). int4 values
are stored two to a byte (offset by 8). The scales are float32.

Pure functions of one tensor, no communication: :func:`encode` makes the bytes a rank sends,
:func:`decode` reads any rank's back (every rank decodes every rank's in the same order, so
the average is the same everywhere).
"""

from __future__ import annotations

import math

import torch

from phalanx._check import check_choice, check_int

__all__ = ["CODECS", "decode", "dequantise", "encode", "encoded_bytes", "error_bound", "quantise"]

CODECS = ("fp32", "bf16", "int8", "int4")
_QMAX = {"int8": 127, "int4": 7}
_SCALE_BYTES = 4


def _check(codec: object, block: object, where: str) -> tuple[str, int]:
    return (
        check_choice("codec", codec, choices=CODECS, where=where),
        check_int("block", block, min=1, where=where),
    )


def quantise(x: torch.Tensor, codec: str, block: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)`` of the 1-D float tensor ``x`` in ``codec``.

    fp32 / bf16: the values cast, no scales. int8: one int8 per element. int4: two per byte
    (uint8, the last one padded). Scales: float32, one per block (empty for the floats).
    """
    codec, block = _check(codec, block, "quantise")
    x = x.detach().reshape(-1).float()
    none = torch.empty(0, dtype=torch.float32, device=x.device)
    if codec in ("fp32", "bf16"):
        return x.to(torch.bfloat16 if codec == "bf16" else torch.float32), none
    qmax = _QMAX[codec]
    blocks = math.ceil(x.numel() / block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)
    padded[: x.numel()] = x
    rows = padded.view(blocks, block)
    scales = rows.abs().amax(dim=1) / qmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(rows / safe[:, None]).clamp_(-qmax, qmax).to(torch.int8).reshape(-1)
    q = q[: x.numel()]
    return (q if codec == "int8" else _pack4(q)), scales


def dequantise(
    values: torch.Tensor, scales: torch.Tensor, codec: str, numel: int, block: int = 256
) -> torch.Tensor:
    """The float32 tensor of ``numel`` elements that :func:`quantise` encoded."""
    codec, block = _check(codec, block, "dequantise")
    if codec in ("fp32", "bf16"):
        return values.float()[:numel]
    q = values if codec == "int8" else _unpack4(values, numel)
    blocks = math.ceil(numel / block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=values.device)
    padded[:numel] = q.float()
    return (padded.view(blocks, block) * scales[:, None]).reshape(-1)[:numel]


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in -7..7 as nibbles 1..15, two per byte (low nibble first)."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    if u.numel() % 2:
        u = torch.cat([u, u.new_full((1,), 8)])
    return u[0::2] | (u[1::2] << 4)


def _unpack4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    low = (packed & 0x0F).to(torch.int16) - 8
    high = (packed >> 4).to(torch.int16) - 8
    return torch.stack([low, high], dim=1).reshape(-1)[:numel].to(torch.int8)


def error_bound(x: torch.Tensor, codec: str, block: int = 256) -> torch.Tensor:
    """Per element, the most :func:`quantise` then :func:`dequantise` may move ``x``: half a
    step of its block (``max|x| / (2·qmax)``); bf16 half an ulp at 8 bits (``|x|·2⁻⁸``);
    0 for fp32."""
    codec, block = _check(codec, block, "error_bound")
    x = x.detach().reshape(-1).float()
    if codec == "fp32":
        return torch.zeros_like(x)
    if codec == "bf16":
        return x.abs() * 2.0**-8
    blocks = math.ceil(x.numel() / block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)
    padded[: x.numel()] = x.abs()
    half_step = padded.view(blocks, block).amax(dim=1) / (2 * _QMAX[codec])
    return half_step.repeat_interleave(block)[: x.numel()]


def encoded_bytes(numel: int, codec: str, block: int = 256) -> int:
    """Bytes :func:`encode` makes of ``numel`` elements (values and scales)."""
    codec, block = _check(codec, block, "encoded_bytes")
    numel = check_int("numel", numel, min=0, where="encoded_bytes")
    if codec in ("fp32", "bf16"):
        return numel * (4 if codec == "fp32" else 2)
    values = numel if codec == "int8" else math.ceil(numel / 2)
    return values + _SCALE_BYTES * math.ceil(numel / block)


def encode(x: torch.Tensor, codec: str, block: int = 256) -> torch.Tensor:
    """``x`` quantised, as one uint8 tensor: the values' bytes, then the scales'."""
    values, scales = quantise(x, codec, block)
    return torch.cat([_bytes(values), _bytes(scales)])


def decode(raw: torch.Tensor, codec: str, numel: int, block: int = 256) -> torch.Tensor:
    """The float32 tensor that :func:`encode` made ``raw`` of."""
    codec, block = _check(codec, block, "decode")
    if raw.numel() != encoded_bytes(numel, codec, block):
        raise ValueError(
            f"decode: {raw.numel()} bytes do not hold {numel} elements in {codec} "
            f"(block={block}: {encoded_bytes(numel, codec, block)} bytes)"
        )
    if codec in ("fp32", "bf16"):
        dtype = torch.float32 if codec == "fp32" else torch.bfloat16
        return raw.clone().view(dtype).float()  # a copy: a slice's offset may not align
    split = numel if codec == "int8" else math.ceil(numel / 2)
    values = raw[:split] if codec == "int4" else raw[:split].view(torch.int8)
    scales = raw[split:].clone().view(torch.float32)
    return dequantise(values, scales, codec, numel, block)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)
