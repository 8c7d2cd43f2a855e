"""Reduce ops and dtypes of the shared-memory backend, checked and computed as gloo does.

gloo (torch 2.13) reduces float64/32/16, bfloat16, int8/32/64, uint8 and bool with SUM,
PRODUCT, MIN and MAX; BAND, BOR and BXOR on integers and bool only; AVG on floating types (a sum,
then a division by the group size); PREMUL_SUM not at all. Complex tensors reach the backend as
real views (torch's Python layer converts them for SUM and AVG). This backend accepts the same,
plus int16, which gloo refuses.

Numerics: a reduction is a chain of elementwise torch ops in rank order, each rounding to the
tensor's dtype (float16 and bfloat16 are not accumulated in float32: gloo rounds after every
pairwise step too). Integer results and MIN/MAX are therefore identical to gloo's; floating SUM
and PRODUCT equal gloo's bit for bit where the order of operations agrees (always for two
ranks, since a + b == b + a exactly).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.distributed import ReduceOp

__all__ = ["DTYPES", "check_reduction", "op_code", "op_name", "reduce_into"]

DTYPES: tuple[torch.dtype, ...] = (
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
)

_Binary = Callable[..., torch.Tensor]
_BINARY: dict[int, _Binary] = {
    ReduceOp.SUM.value: torch.add,
    ReduceOp.AVG.value: torch.add,
    ReduceOp.PRODUCT.value: torch.mul,
    ReduceOp.MIN.value: torch.minimum,
    ReduceOp.MAX.value: torch.maximum,
    ReduceOp.BAND.value: torch.bitwise_and,
    ReduceOp.BOR.value: torch.bitwise_or,
    ReduceOp.BXOR.value: torch.bitwise_xor,
}
_NAMES = {v.value: k for k, v in ReduceOp.RedOpType.__members__.items()}
_BITWISE = {ReduceOp.BAND.value, ReduceOp.BOR.value, ReduceOp.BXOR.value}
AVG = ReduceOp.AVG.value


def op_code(op: object) -> int:
    """The integer code of a ``ReduceOp`` (or of its ``RedOpType``)."""
    red = getattr(op, "op", op)
    return int(getattr(red, "value", red))  # type: ignore[call-overload]


def op_name(code: int) -> str:
    return _NAMES.get(code, str(code))


def check_dtype(dtype: torch.dtype, where: str) -> None:
    if dtype not in DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
        raise TypeError(f"{where}: backend 'shm' has no {dtype} (it supports {names})")


def check_reduction(code: int, dtype: torch.dtype, where: str) -> None:
    """Raise for a reduce op or dtype gloo refuses too, naming both."""
    check_dtype(dtype, where)
    if code not in _BINARY:
        raise ValueError(f"{where}: backend 'shm' does not support op=ReduceOp.{op_name(code)}")
    floating = dtype.is_floating_point
    if code in _BITWISE and floating:
        raise ValueError(
            f"{where}: op=ReduceOp.{op_name(code)} needs an integer or bool tensor, got {dtype}"
        )
    if code == AVG and not floating:
        raise ValueError(f"{where}: op=ReduceOp.AVG needs a floating tensor, got {dtype}")


def reduce_into(out: torch.Tensor, inputs: Sequence[torch.Tensor], code: int) -> None:
    """``out = inputs[0] (op) inputs[1] (op) ...`` in this order; AVG then divides by len(inputs).

    ``out`` may be one of the inputs only if it is the first.
    """
    fn = _BINARY[code]
    if len(inputs) == 1:
        out.copy_(inputs[0])
    else:
        fn(inputs[0], inputs[1], out=out)
        for t in inputs[2:]:
            fn(out, t, out=out)
    if code == AVG:
        out.div_(len(inputs))
