"""Compute stood in for by sleep, so that ranks sharing few cores measure schedules, not
arithmetic: a sleep frees the CPU for the other ranks."""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["SlowBackward"]


class SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps ``seconds`` before passing the gradient on: where it
    sits in the graph (on a weight's branch, before the first gradient) says what it delays."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None
