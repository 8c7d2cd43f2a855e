"""A backward in two passes (ZB's ``I`` then ``W``) gives backward()'s gradients, bit for bit,
and the ``I`` pass computes no weight's gradient."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from phalanx.models import GPT, GPTConfig
from phalanx.pipeline.split_backward import backward_input, backward_weight


class _Reused(nn.Module):
    """One Linear applied twice along the input's path, and a parameter off it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.shift = nn.Linear(6, 6), nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.lin(x)) + self.shift


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 3))


def _block() -> nn.Module:
    return GPT(GPTConfig(65, 16, 1, 4, 32)).blocks[0]


CASES: list[tuple[str, Callable[[], nn.Module], tuple[int, ...], bool]] = [
    ("mlp", _mlp, (4, 5), True),
    ("mlp-first-stage", _mlp, (4, 5), False),  # the input needs no gradient: W does it all
    ("weight-reused", _Reused, (3, 6), True),
    ("gpt-block", _block, (2, 16, 32), True),
]


@pytest.mark.parametrize(
    ("build", "shape", "grad"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_two_passes_equal_one_backward(
    build: Callable[[], nn.Module], shape: tuple[int, ...], grad: bool
) -> None:
    torch.manual_seed(0)
    model = build()
    twin = copy.deepcopy(model)
    x = torch.randn(*shape, requires_grad=grad)
    x_twin = x.detach().clone().requires_grad_(grad)
    out = model(x)
    g = torch.randn_like(out)
    out.backward(g)
    out_twin = twin(x_twin)
    found, work = backward_input([out_twin], [g], [x_twin], twin.parameters())
    assert all(p.grad is None for p in twin.parameters())  # I computed no weight gradient
    if grad:
        assert torch.equal(found[0], x.grad) and torch.equal(x_twin.grad, x.grad)
    else:
        assert found == [None]
    backward_weight(work)
    for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        assert q.grad is not None and torch.equal(q.grad, p.grad), name


def test_a_scalar_loss_needs_no_output_gradient() -> None:
    torch.manual_seed(0)
    model, x = _mlp(), torch.randn(4, 5, requires_grad=True)
    twin = copy.deepcopy(model)
    model(x).square().mean().backward()
    loss = twin(x.detach().requires_grad_()).square().mean()
    _, work = backward_input([loss], None, [], twin.parameters())
    backward_weight(work)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(q.grad, p.grad)
