"""Measure a real model for ``phalanx plan <script.py>``: Ψ and activation bytes.

The script protocol. ``phalanx plan`` imports the script with ``__name__`` set to
``"__phalanx_plan__"`` (so its ``if __name__ == "__main__":`` block does not run), with the
script's folder first on ``sys.path``, and calls:

- ``build_model() -> nn.Module`` (required): the model as training would build it.
- ``example_batch(batch_size: int) -> tuple[Tensor, ...]`` (required): the inputs of one
  micro-batch of ``batch_size`` examples; the model is called as ``model(*batch)``.
- ``loss_fn(output, batch) -> Tensor`` (optional): the scalar loss. Without it the loss is the
  output itself when it is a 0-dim tensor, the first 0-dim tensor of a tuple/list output (as in
  ``(logits, loss)``), or else the mean of the output tensor.

Activations are the bytes one training-mode forward and loss computation holds for backward
(:func:`activation_bytes`): what it allocated and has not freed when the loss is computed, as
torch's profiler records allocations, plus the inputs autograd saves; the model's parameters and
buffers excluded. Temporaries freed during the forward, and memory the backward pass allocates,
are not included. With activation checkpointing applied, what it keeps is what is counted.
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from phalanx.plan.allocations import allocations
from phalanx.plan.storage import StorageKey, storage_key, storage_nbytes, tensors_in

__all__ = ["ModelScript", "activation_bytes", "load_script", "parameter_count"]

LossFn = Callable[[Any, Sequence[Any]], torch.Tensor]


@dataclass(frozen=True)
class ModelScript:
    """The protocol functions of a training script (see the module docstring)."""

    path: Path
    """The script file."""
    build_model: Callable[[], nn.Module]
    """Returns the model."""
    example_batch: Callable[[int], Sequence[Any]]
    """Returns the inputs of one micro-batch of the given size."""
    loss_fn: LossFn | None = None
    """Optional ``loss_fn(output, batch)``."""


def load_script(path: str | Path) -> ModelScript:
    """Import ``path`` without running its ``__main__`` block and take its protocol functions.

    Raises:
        FileNotFoundError: No such file.
        ValueError: The script lacks ``build_model`` or ``example_batch``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"phalanx plan: script {str(path)!r} does not exist")
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)  # as `python script.py` would: sibling modules import
    try:
        namespace = runpy.run_path(str(path), run_name="__phalanx_plan__")
    finally:
        sys.path.remove(folder)
    missing = [n for n in ("build_model", "example_batch") if not callable(namespace.get(n))]
    if missing:
        needed = " and ".join(f"{n}()" for n in missing)
        raise ValueError(
            f"phalanx plan: script {str(path)!r} must define {needed} (see `phalanx plan --help`)"
        )
    loss_fn = namespace.get("loss_fn")
    return ModelScript(
        path,
        namespace["build_model"],
        namespace["example_batch"],
        loss_fn if callable(loss_fn) else None,
    )


def parameter_count(model: nn.Module) -> int:
    """Ψ: distinct parameter elements (``parameters()`` yields a tied weight once)."""
    return sum(p.numel() for p in model.parameters())


def default_loss(output: Any) -> torch.Tensor:
    """The loss when a script has no ``loss_fn`` (rules in the module docstring)."""
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else output.float().mean()
    if isinstance(output, tuple | list):
        for item in output:
            if isinstance(item, torch.Tensor) and item.dim() == 0:
                return item
        first = next((item for item in output if isinstance(item, torch.Tensor)), None)
        if first is not None:
            return first.float().mean()
    raise TypeError(
        f"phalanx plan: cannot take a loss from a model output of type {type(output).__name__};"
        " define loss_fn(output, batch) in the script"
    )


def activation_bytes(model: nn.Module, batch: Sequence[Any], loss_fn: LossFn | None = None) -> int:
    """Bytes one training-mode forward of ``model(*batch)`` (and its loss) holds for backward.

    What the forward allocates and has not freed when the loss is computed (the profiler's
    allocation records, so whatever keeps a tensor alive counts: autograd's saved tensors,
    activation checkpointing's inputs and a selective policy's kept results), less the loss
    itself, plus the storages of ``batch`` that autograd saves (allocated before the forward,
    but held by it). The model's parameters and buffers are not activations and are not
    counted. The forward runs once with gradients enabled; the graph is then dropped (no
    backward, no parameter changes).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"activation_bytes: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(batch, tuple | list):
        raise TypeError(
            f"activation_bytes: batch must be a tuple of inputs, got {type(batch).__name__}"
        )
    inputs = {storage_key(t): storage_nbytes(t) for t in tensors_in(batch)}
    held_inputs: dict[StorageKey, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key in inputs:
            held_inputs[key] = inputs[key]
        return t

    def forward() -> torch.Tensor:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, _same):
            output = model(*batch)
            loss = loss_fn(output, batch) if loss_fn is not None else default_loss(output)
            del output  # what the graph does not hold is freed here
            return loss

    was_training = model.training
    model.train()
    try:
        loss, allocated = allocations(forward)
    finally:
        model.train(was_training)
    return max(0, allocated.held - storage_nbytes(loss)) + sum(held_inputs.values())


def _same(t: torch.Tensor) -> torch.Tensor:
    return t
