"""``DistributedDataParallel(mixed_precision=...)``: compute in low precision, keep fp32 weights.

torch's DDP takes a ``_MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)``; phalanx takes
the same object (or any with those three fields). Before each forward the parameters are cast
to ``param_dtype`` (the full-precision values are kept aside), floating inputs likewise, so
forward and backward run in low precision; gradients are reduced in ``reduce_dtype`` (the bucket
dtype); at the end of backward the full-precision parameters come back and the gradients are
upcast to their dtype, so the optimizer steps in full precision. Buffers are cast once to
``buffer_dtype``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from phalanx.data_parallel.scatter_gather import map_tensors

__all__ = ["ParamCaster", "cast_inputs"]


class ParamCaster:
    """Swaps parameters between their full-precision values and low-precision copies."""

    def __init__(
        self, config: Any, params: list[nn.Parameter], buffers: list[torch.Tensor]
    ) -> None:
        for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            if not hasattr(config, field):
                raise TypeError(
                    f"DistributedDataParallel: mixed_precision={config!r} has no {field!r}; pass "
                    f"torch.nn.parallel.distributed._MixedPrecision(param_dtype=..., ...)"
                )
        self.param_dtype: torch.dtype | None = config.param_dtype
        self.reduce_dtype: torch.dtype | None = config.reduce_dtype or config.param_dtype
        self.params = params
        self.full = [p.data for p in params]
        if config.buffer_dtype is not None:
            with torch.no_grad():
                for b in buffers:
                    if b.is_floating_point():
                        b.data = b.data.to(config.buffer_dtype)

    def to_low(self) -> None:
        """Before forward: parameters (and accumulated gradients) in ``param_dtype``."""
        if self.param_dtype is None:
            return
        with torch.no_grad():
            for p, full in zip(self.params, self.full):
                p.data = full.to(self.param_dtype)
                if p.grad is not None and p.grad.dtype != self.param_dtype:
                    p.grad.data = p.grad.data.to(self.param_dtype)

    def to_full(self) -> None:
        """After backward: full-precision parameters back, gradients upcast to match."""
        with torch.no_grad():
            for p, full in zip(self.params, self.full):
                p.data = full
                if p.grad is not None and p.grad.dtype != full.dtype:
                    p.grad.data = p.grad.data.to(full.dtype)


def cast_inputs(dtype: torch.dtype | None, obj: Any) -> Any:
    """Cast every floating-point tensor in ``obj`` (nested tuples, lists, dicts) to ``dtype``."""
    if dtype is None:
        return obj
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, obj)
