"""What a replica of the model synchronises: its parameters and floating-point buffers.

LocalSGD averages both; DiLoCo's outer optimizer steps the parameters and averages the
buffers (batch-norm running statistics), which have no gradient. Integer buffers (a batch
norm's ``num_batches_tracked``) advance alike on every rank and are left alone: an average
of integers is not an integer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Replica", "nbytes"]


def nbytes(tensors: list[torch.Tensor]) -> int:
    """Bytes held by ``tensors``."""
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class Replica:
    """One rank's model, as named tensors in the order every rank lists them."""

    params: list[tuple[str, torch.Tensor]]
    """Trained parameters (detached views), by ``named_parameters()`` name."""
    buffers: list[tuple[str, torch.Tensor]]
    """Floating-point buffers, by ``named_buffers()`` name."""

    @staticmethod
    def of(model: nn.Module) -> Replica:
        """``model``'s parameters that require a gradient and its floating-point buffers."""
        params = [(n, p.detach()) for n, p in model.named_parameters() if p.requires_grad]
        buffers = [(n, b) for n, b in model.named_buffers() if b.is_floating_point()]
        return Replica(params, buffers)

    @property
    def param_tensors(self) -> list[torch.Tensor]:
        """The parameters' tensors (detached views: updating them updates the model)."""
        return [p for _, p in self.params]

    @property
    def buffer_tensors(self) -> list[torch.Tensor]:
        """The floating-point buffers."""
        return [b for _, b in self.buffers]
