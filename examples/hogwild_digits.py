"""Seed 000's Hogwild example, made robust: 2 processes train one shared MLP on digits, no locks.

    python examples/hogwild_digits.py [--processes 2] [--epochs 15]

The seed calls ``model.share_memory()`` and starts ``mp.Process(target=train, args=(model,))``
by hand; ``phalanx.hogwild.train`` does the same with spawn (never a bare fork after tensor
math), gives each process its shard of the data, a seed and one thread, and names the rank
whose process failed. Real 8x8 handwritten digits shipped with scikit-learn (no download).
Prints the test accuracy; exits 1 if it is below 95%.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

import phalanx.hogwild
from phalanx._optional import require

require("examples", "examples/hogwild_digits.py")  # scikit-learn (digits), checked first

TARGET = 0.95


def digits(seed: int = 0) -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    """1437 training and 360 test digits, pixels scaled to [0, 1]."""
    import phalanx.datasets

    x, y = phalanx.datasets.digits()  # scikit-learn's, without importing scikit-learn
    images, labels = torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    train, test = order[:1437], order[1437:]
    ds = torch.utils.data.TensorDataset
    return ds(images[train], labels[train]), ds(images[test], labels[test])


def train(
    rank: int, model: nn.Module, shard: torch.utils.data.Subset, epochs: int, lr: float
) -> None:
    """One Hogwild process: plain SGD on its shard; every step writes the shared parameters."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.5)  # the seed's optimizer
    loader = torch.utils.data.DataLoader(shard, batch_size=16, shuffle=True)
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()  # gradients are per process; only parameters are shared
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()


@torch.no_grad()
def accuracy(model: nn.Module, data: torch.utils.data.TensorDataset) -> float:
    x, y = data.tensors
    return (model(x).argmax(1) == y).float().mean().item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--start-method", default="spawn", help="spawn or forkserver")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds, for all processes")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    train_set, test_set = digits()
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    phalanx.hogwild.train(
        model,
        train,
        args.processes,
        dataset=train_set,
        args=(args.epochs, args.lr),
        start_method=args.start_method,
        timeout=args.timeout,
    )
    acc = accuracy(model, test_set)
    print(f"hogwild, {args.processes} processes, {args.epochs} epochs: test accuracy {acc:.2%}")
    return 0 if acc >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
