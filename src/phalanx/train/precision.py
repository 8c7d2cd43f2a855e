"""Precision for the job API, in the one vocabulary of :mod:`phalanx.precisions`.

``bf16-mixed`` (autocast, CPU and GPU) and ``fp16-mixed`` (autocast with a loss scaler, GPU)
keep parameters and optimizer state in fp32 (the "master weights"); only the forward runs in the
low-precision dtype under autocast, as in Micikevicius et al., "Mixed Precision Training" (2018).
``bf16-true`` converts the model to bf16 before the strategy wraps it and casts floating inputs
to bf16 in the forward (parameters, gradients and optimizer state are all bf16), as Lightning's
"bf16-true" does.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from phalanx.precisions import JOB_PRECISIONS, check_precision

__all__ = ["PRECISIONS", "Precision"]

PRECISIONS = JOB_PRECISIONS
"""The precisions a job trains in (their older spellings are accepted too)."""


class Precision:
    """Autocast around the model's forward, the fp16 gradient scaler, or a bf16 model."""

    def __init__(self, name: str, device: torch.device) -> None:
        name = check_precision("precision", name, allowed=JOB_PRECISIONS)
        if name == "fp16-mixed" and device.type != "cuda":
            raise ValueError(
                "precision='fp16-mixed' needs a CUDA device (fp16 with a gradient scaler); on "
                "CPU use precision='bf16-mixed'"
            )
        self.name = name
        self.device = device
        self.dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(name)
        """The autocast dtype (None: no autocast)."""
        self.param_dtype = torch.bfloat16 if name == "bf16-true" else None
        """The dtype the model is converted to (None: kept as built)."""
        self.scaler = torch.amp.GradScaler("cuda") if name == "fp16-mixed" else None

    def place(self, model: nn.Module, device: torch.device) -> None:
        """Move ``model`` to ``device`` (and to bf16 for ``bf16-true``), before it is wrapped.

        Parameters keep their identity (``nn.Module.to``), so an optimizer built on them
        still holds them; its state is created in their dtype at its first step.
        """
        if self.param_dtype is None:
            model.to(device)
        else:
            model.to(device, dtype=self.param_dtype)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The autocast context for a forward pass (a no-op in fp32)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def wrap_forward(self, model: nn.Module) -> None:
        """Run ``model``'s forward under autocast from now on (``bf16-true``: with its floating
        inputs cast to bf16; fp32: no change)."""
        if self.dtype is None and self.param_dtype is None:
            return
        forward: Callable[..., Any] = model.forward
        cast = self._cast_inputs

        @functools.wraps(forward)
        def autocast_forward(*args: Any, **kwargs: Any) -> Any:
            with self.autocast():
                return forward(*cast(args), **cast(kwargs))

        model.forward = autocast_forward

    def _cast_inputs(self, values: Any) -> Any:
        dtype = self.param_dtype
        if dtype is None:
            return values

        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(dtype) if t.is_floating_point() else t

        return tree_map_only(torch.Tensor, cast, values)

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
