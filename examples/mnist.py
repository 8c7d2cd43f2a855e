"""Seed 004's ``mnist.py``, on scikit-learn's handwritten digits (no download), with phalanx.

Started by hand, one terminal per process, as in the seed:

    python examples/mnist.py --init-method tcp://127.0.0.1:22225 --rank 0 --world-size 3
    python examples/mnist.py --init-method tcp://127.0.0.1:22225 --rank 1 --world-size 3
    python examples/mnist.py --init-method tcp://127.0.0.1:22225 --rank 2 --world-size 3

or with the launcher (env:// initialisation):

    phalanx run --standalone --nproc-per-node 3 examples/mnist.py
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import phalanx
from phalanx._optional import require

require("examples", "examples/mnist.py")  # scikit-learn (digits), checked first


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, 1, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, 1, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


def load_data(
    batch_size: int = 32,
) -> tuple[torch.utils.data.DataLoader, torch.Tensor, torch.Tensor]:
    from phalanx.datasets import digits

    x, y = digits()  # scikit-learn's, without importing scikit-learn
    images = (torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0 - 0.3) / 0.4
    labels = torch.tensor(y)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    train, test = order[:1437], order[1437:]
    train_set = torch.utils.data.TensorDataset(images[train], labels[train])
    # Each process loads the same data and the sampler hands it its own part.
    sampler = phalanx.DistributedSampler(train_set, shuffle=True)
    loader = torch.utils.data.DataLoader(train_set, batch_size=batch_size, sampler=sampler)
    return loader, images[test], labels[test]


def main() -> None:
    parser = argparse.ArgumentParser(description="PyTorch MNIST Example (seed 004), on digits")
    parser.add_argument("--backend", type=str, default="gloo", choices=["gloo", "nccl", "mpi"])
    parser.add_argument("--init-method", default=None, type=str, help="env://, tcp://, file://")
    parser.add_argument("--rank", default=-1, type=int, help="Distributed rank")
    parser.add_argument("--world-size", default=-1, type=int, help="Distributed world_size")
    parser.add_argument("--epochs", default=8, type=int)
    args = parser.parse_args()
    world = phalanx.init_process_group(
        backend=args.backend,
        init_method=args.init_method,
        rank=None if args.rank < 0 else args.rank,
        world_size=None if args.world_size < 0 else args.world_size,
    )
    with phalanx.main_first():  # rank 0 prepares (caches) the data, the others wait
        train_loader, x_test, y_test = load_data()
    model = phalanx.DistributedDataParallel(Net())
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    for epoch in range(args.epochs):
        train_loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        for data, target in train_loader:
            optimizer.zero_grad()
            F.cross_entropy(model(data), target).backward()
            optimizer.step()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        if world.is_main:
            print(f"epoch {epoch}: test accuracy {100 * accuracy:.2f}%", flush=True)
    phalanx.destroy_process_group()


if __name__ == "__main__":
    main()
