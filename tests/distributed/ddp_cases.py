"""Models, data and the single-process reference shared by the data-parallel parity tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

STEPS = 4
PER_RANK = 6  # samples per rank per micro-step


class MLP(nn.Module):
    def __init__(self, unused: bool = False, hidden: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(10, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, 3)
        self.spare = nn.Linear(hidden, 3) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8 * 6 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).flatten(1))


CASES: dict[str, dict[str, Any]] = {
    "sgd": {"opt": "sgd"},
    "adamw": {"opt": "adamw"},
    "sgd_many_buckets": {"opt": "sgd", "bucket_cap_mb": 0.002},
    "no_sync": {"opt": "sgd", "accum": 3, "bucket_cap_mb": 0.002},
    "unused": {"opt": "adamw", "unused": True},
    "bucket_view": {"opt": "sgd", "bucket_view": True, "bucket_cap_mb": 0.002},
    "bucket_view_adamw_no_sync": {"opt": "adamw", "bucket_view": True, "accum": 2},
    "batchnorm": {"opt": "sgd", "model": "cnn"},
}


def make_model(case: dict[str, Any], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if case.get("model") == "cnn":
        return CNN()
    return MLP(unused=case.get("unused", False))


def make_optimizer(case: dict[str, Any], params: Any) -> torch.optim.Optimizer:
    if case["opt"] == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def batch(case: dict[str, Any], step: int, micro: int, rank: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    shape = (PER_RANK, 3, 6, 6) if case.get("model") == "cnn" else (PER_RANK, 10)
    return torch.randn(shape, generator=g), torch.randint(0, 3, (PER_RANK,), generator=g)


def reference(case: dict[str, Any], world: int) -> list[torch.Tensor]:
    """One process emulating `world` replicas: shard losses averaged, buffers from rank 0."""
    model = make_model(case, seed=0)
    opt = make_optimizer(case, [p for p in model.parameters()])
    accum = case.get("accum", 1)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(accum):
            buffers = [b.clone() for b in model.buffers()]
            after_rank0: list[torch.Tensor] = []
            for r in range(world):
                for b, saved in zip(model.buffers(), buffers):
                    b.copy_(saved)
                x, y = batch(case, step, micro, r)
                loss = nn.functional.cross_entropy(model(x), y) / (world * accum)
                loss.backward()
                if r == 0:
                    after_rank0 = [b.clone() for b in model.buffers()]
            for b, kept in zip(model.buffers(), after_rank0):
                b.copy_(kept)
        opt.step()
    return [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]
