"""DiLoCo's outer optimizer, and how its gradients travel: one options object.

The outer optimizer is ``torch.optim.SGD`` over the global parameters θ (Douillard et al.
2023 use lr 0.7, Nesterov momentum 0.9); its update is torch's: buf = μ·buf + Δ,
θ −= lr·(Δ + μ·buf) with Nesterov, lr·buf without. ``codec`` and ``block`` say how the
pseudo-gradient Δ crosses the link (:mod:`.quantise`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from phalanx._check import FLAG, check_choice, check_float, check_int, fail, rule
from phalanx._fields import check_fields
from phalanx.local_sgd.quantise import CODECS

__all__ = ["Outer", "check_momentum"]


def check_momentum(name: str, value: object, *, where: str = "") -> float:
    """A momentum: a number >= 0 and < 1 (1 would never forget a pseudo-gradient)."""
    number = check_float(name, value, min=0, where=where)
    if number >= 1:
        raise fail(name, value, "a number >= 0 and < 1", where=where)
    return number


@dataclass(frozen=True)
class Outer:
    """DiLoCo's outer step.

    Args:
        lr: The outer SGD's learning rate (> 0).
        momentum: Its momentum (0 <= momentum < 1).
        nesterov: Nesterov momentum (ignored without momentum).
        codec: How the pseudo-gradient travels: "fp32", "bf16", "int8" or "int4".
        block: Elements per quantisation scale (int8, int4).
    """

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    codec: str = "fp32"
    block: int = 256

    def __post_init__(self) -> None:
        check_fields(
            self,
            lr=rule(check_float, above=0),
            momentum=rule(check_momentum),
            nesterov=FLAG,
            codec=rule(check_choice, choices=CODECS),
            block=rule(check_int, min=1),
        )

    def optimizer(self, params: Sequence[torch.Tensor]) -> torch.optim.SGD:
        """The outer SGD over ``params`` (θ)."""
        nesterov = self.nesterov and self.momentum > 0  # torch refuses Nesterov without it
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, nesterov=nesterov)
