"""Model-state memory and communication volume per device, from the ZeRO paper's formulas.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(2019), §3 and §7: with Ψ parameters, N data-parallel ranks and K bytes of optimizer state per
parameter (K = 12 for mixed-precision Adam: fp32 master weights, momentum and variance),

    DDP     (2 + 2 + K) Ψ          all-reduce of gradients: 2Ψ elements moved per rank
    ZeRO-1  2Ψ + 2Ψ + KΨ/N         reduce-scatter + all-gather: 2Ψ
    ZeRO-2  2Ψ + (2 + K)Ψ/N        2Ψ
    ZeRO-3  (2 + 2 + K)Ψ / N       all-gather twice + reduce-scatter: 3Ψ

for fp16 parameters and gradients (2 bytes each): precision "fp16-master". The other precisions
of :mod:`phalanx.precisions` change the bytes per parameter: fp32 and the autocast ones a
``phalanx.Job`` trains in ("bf16-mixed", "fp16-mixed") hold fp32 parameters and gradients (4
bytes each) and K counts only the optimizer's own state (8 for Adam); "bf16-true" holds
everything in bf16 (2, 2 and K/2).
"""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.precisions import PRECISIONS, check_precision

__all__ = ["OPTIMIZERS", "PRECISIONS", "StrategyEstimate", "bytes_per_param", "estimate"]

# Optimizer state in fp32 bytes per parameter, without a master copy of the weights.
OPTIMIZERS = {"adam": 8, "adamw": 8, "sgd": 0, "sgd-momentum": 4, "adagrad": 4}


@dataclass(frozen=True)
class StrategyEstimate:
    """Model-state bytes per device and communication per step for one strategy."""

    strategy: str
    params: float
    """Bytes of parameters held by one device."""
    grads: float
    """Bytes of gradients held by one device."""
    optimizer: float
    """Bytes of optimizer state (including fp32 master weights in mixed precision)."""
    comm_elements: float
    """Elements each rank sends and receives per step (the paper's data-movement volume)."""
    comm_bytes: float
    """``comm_elements`` times the gradient element size."""

    @property
    def total(self) -> float:
        """Parameters + gradients + optimizer state, bytes per device."""
        return self.params + self.grads + self.optimizer


def bytes_per_param(optimizer: str, precision: str) -> tuple[int, int, int]:
    """(parameter bytes, gradient bytes, K optimizer bytes) per parameter."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    precision = check_precision("precision", precision, where="estimate")
    state = OPTIMIZERS[optimizer]
    if precision in ("fp32", "bf16-mixed", "fp16-mixed"):  # fp32 parameters and gradients
        return 4, 4, state
    if precision == "bf16-true":  # pure bf16 training: no master copy
        return 2, 2, state // 2
    return 2, 2, state + 4  # fp16-master: fp32 master weights join the optimizer state


def estimate(
    params: float, dp: int, optimizer: str = "adam", precision: str = "fp16-master"
) -> list[StrategyEstimate]:
    """Per-device model-state memory and per-step communication for DDP and ZeRO-1/2/3.

    Args:
        params: Number of parameters Ψ.
        dp: Data-parallel degree N.
        optimizer: One of ``OPTIMIZERS``.
        precision: A name of :mod:`phalanx.precisions` (or an old spelling): "fp16-master"
            (the paper's: fp16 parameters and gradients, fp32 master weights), "fp32",
            "bf16-mixed", "fp16-mixed" or "bf16-true".
    """
    if params <= 0:
        raise ValueError(f"params must be positive, got {params}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    p, g, k = bytes_per_param(optimizer, precision)
    psi, n = float(params), float(dp)
    rows = [
        ("ddp", p * psi, g * psi, k * psi, 2.0),
        ("zero1", p * psi, g * psi, k * psi / n, 2.0),
        ("zero2", p * psi, g * psi / n, k * psi / n, 2.0),
        ("zero3", p * psi / n, g * psi / n, k * psi / n, 3.0),
    ]
    return [
        StrategyEstimate(name, pb, gb, ob, factor * psi, factor * psi * g)
        for name, pb, gb, ob, factor in rows
    ]
