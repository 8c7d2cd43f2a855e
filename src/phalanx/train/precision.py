"""Mixed precision for the job API: bf16 autocast (CPU and GPU), fp16 with a loss scaler (GPU).

Parameters and optimizer state stay fp32 (the "master weights"); only the forward runs in the
low-precision dtype under autocast, as in Micikevicius et al., "Mixed Precision Training" (2018).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["PRECISIONS", "Precision"]

PRECISIONS = ("fp32", "bf16", "fp16")


class Precision:
    """Autocast around the model's forward, and the fp16 gradient scaler."""

    def __init__(self, name: str, device: torch.device) -> None:
        if name not in PRECISIONS:
            raise ValueError(f"precision={name!r} is not one of {', '.join(PRECISIONS)}")
        if name == "fp16" and device.type != "cuda":
            raise ValueError(
                "precision='fp16' needs a CUDA device (fp16 with a gradient scaler); on CPU "
                "use precision='bf16'"
            )
        self.name = name
        self.device = device
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(name)
        self.scaler = torch.amp.GradScaler("cuda") if name == "fp16" else None

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The autocast context for a forward pass (a no-op in fp32)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def wrap_forward(self, model: nn.Module) -> None:
        """Run ``model``'s forward under autocast from now on (no-op in fp32)."""
        if self.dtype is None:
            return
        forward: Callable[..., Any] = model.forward

        @functools.wraps(forward)
        def autocast_forward(*args: Any, **kwargs: Any) -> Any:
            with self.autocast():
                return forward(*args, **kwargs)

        model.forward = autocast_forward

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled when training in fp16."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()``, through the scaler in fp16 (skips steps with inf/nan grads)."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()
