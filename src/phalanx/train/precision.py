"""Precision for the job API, in the one vocabulary of :mod:`phalanx.precisions`.

``bf16-mixed`` and ``fp16-mixed`` (autocast, with a loss scaler for fp16; CPU and GPU alike)
keep parameters and optimizer state in fp32 (the "master weights"); only the forward runs in the
low-precision dtype under autocast, as in Micikevicius et al., "Mixed Precision Training" (2018).
``bf16-true`` converts the model to bf16 before the strategy wraps it and casts floating inputs
to bf16 in the forward (parameters, gradients and optimizer state are all bf16), as Lightning's
"bf16-true" does.

fp16's scaler is torch's ``GradScaler`` for the job's device type (``"cuda"`` or ``"cpu"``: torch
autocasts Linear and convolution layers to fp16 on CPU too, so the whole fp16 path runs, and is
tested, without a GPU), extended to find the gradients each rank steps and to agree on overflows
over the ranks that hold different ones (:mod:`phalanx.train.grad_scaler`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from phalanx._check import check_float, check_int
from phalanx.precisions import JOB_PRECISIONS, check_precision
from phalanx.train.grad_scaler import AgreedGradScaler, GradShards

__all__ = ["PRECISIONS", "Precision"]

PRECISIONS = JOB_PRECISIONS
"""The precisions a job trains in (their older spellings are accepted too)."""


class Precision:
    """Autocast around the model's forward, the fp16 gradient scaler, or a bf16 model."""

    def __init__(self, name: str, device: torch.device) -> None:
        name = check_precision("precision", name, allowed=JOB_PRECISIONS)
        self.name = name
        self.device = device
        self.dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(name)
        """The autocast dtype (None: no autocast)."""
        self.param_dtype = torch.bfloat16 if name == "bf16-true" else None
        """The dtype the model is converted to (None: kept as built)."""
        self.scaler: AgreedGradScaler | None = None
        """fp16's gradient scaler (None in other precisions); see :meth:`configure_scaler`."""
        if name == "fp16-mixed":
            self.scaler = AgreedGradScaler(device.type)
        self._scaled = False

    def configure_scaler(
        self,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        """Set fp16's loss-scale options (torch ``GradScaler``'s, same defaults), before the
        first backward: e.g. ``job.precision.configure_scaler(init_scale=2.0**10)``.

        Raises:
            ValueError: not ``fp16-mixed``, a loss already scaled, or a bad option (named,
                with its value).
        """
        where = "Precision.configure_scaler"
        if self.scaler is None:
            raise ValueError(
                f"{where}(): precision={self.name!r} has no gradient scaler; use "
                f"precision='fp16-mixed'"
            )
        if self._scaled:
            raise ValueError(f"{where}(): call it before the first backward, not after")
        self.scaler = AgreedGradScaler(
            self.device.type,
            init_scale=check_float("init_scale", init_scale, above=0, where=where),
            growth_factor=check_float("growth_factor", growth_factor, min=1, where=where),
            backoff_factor=check_float(
                "backoff_factor", backoff_factor, above=0, max=1, where=where
            ),
            growth_interval=check_int("growth_interval", growth_interval, min=1, where=where),
        )

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
        if self.scaler is None:
            loss.backward()
            return
        self._scaled = True
        self.scaler.scale(loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer, shards: GradShards | None) -> None:
        """fp16: divide ``optimizer``'s gradients (where ``shards`` says they are) by the scale
        and check them for inf/NaN, agreed over ``shards.group``; once per step, before
        clipping. A no-op in other precisions."""
        if self.scaler is not None:
            self.scaler.route(optimizer, shards)
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, shards: GradShards | None = None) -> None:
        """``optimizer.step()``, through the scaler in fp16: the step is skipped, and the scale
        backed off, on every rank at once when any rank's gradients (``shards``) hold an
        inf/NaN."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.route(optimizer, shards)
        self.scaler.step(optimizer)
        self.scaler.update()
