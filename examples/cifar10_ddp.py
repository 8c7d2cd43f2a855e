"""Seed 002's CIFAR10 ``main.py`` with one import line changed to use phalanx's DDP.

    phalanx run --standalone --nproc-per-node 2 examples/cifar10_ddp.py --epochs 2

Offline by default: a synthetic, CIFAR10-shaped data set (3x32x32 images, 10 classes; the class
is encoded in the images so the loss visibly falls). ``--torchvision`` uses torchvision's
CIFAR10 instead when it is installed and downloadable. The seed targets GPUs; this port picks
the device so that it also runs on CPUs with gloo. ``--local_rank`` is still accepted (the seed
reads it; with ``phalanx run`` / torchrun it comes from ``LOCAL_RANK``).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from phalanx import DistributedDataParallel as DDP  # was: from torch.nn.parallel import ...

try:
    from tqdm import tqdm
except ImportError:  # tqdm is optional here

    def tqdm(iterable, **_):  # type: ignore[no-untyped-def]
        return iterable


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def synthetic_cifar10(n: int = 1024) -> torch.utils.data.Dataset:
    """CIFAR10-shaped images whose class shows as a brighter horizontal band."""
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.randn(n, 3, 32, 32, generator=g) * 0.5
    for i, y in enumerate(labels.tolist()):
        images[i, :, 3 * y : 3 * y + 3, :] += 1.5
    return torch.utils.data.TensorDataset(images, labels)


def get_dataset(use_torchvision: bool) -> torch.utils.data.DataLoader:
    if use_torchvision:
        import torchvision

        transform = torchvision.transforms.Compose([
            torchvision.transforms.ToTensor(),
            torchvision.transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
        ])  # fmt: skip
        my_trainset = torchvision.datasets.CIFAR10(
            root="./data", train=True, download=True, transform=transform
        )
    else:
        my_trainset = synthetic_cifar10()
    # DDP: DistributedSampler gives each process its own part of the data set.
    train_sampler = torch.utils.data.distributed.DistributedSampler(my_trainset)
    # DDP: batch_size is per process; the global batch is batch_size * world_size.
    return torch.utils.data.DataLoader(my_trainset, batch_size=16, sampler=train_sampler)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", default=int(os.environ.get("LOCAL_RANK", 0)), type=int)
    parser.add_argument("--epochs", default=100, type=int)
    parser.add_argument("--torchvision", action="store_true", help="real CIFAR10 (download)")
    parser.add_argument("--ckpt-dir", default=".", help="where rank 0 saves N.ckpt")
    flags = parser.parse_args()
    local_rank = flags.local_rank
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    trainloader = get_dataset(flags.torchvision)  # prepare data after init
    model = ToyModel().to(device)
    # DDP: load a checkpoint before wrapping, on rank 0 only (wrapping broadcasts it).
    model = DDP(model, device_ids=[local_rank] if use_cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_func = nn.CrossEntropyLoss().to(device)
    model.train()
    iterator = tqdm(range(flags.epochs), disable=dist.get_rank() != 0)
    for epoch in iterator:
        trainloader.sampler.set_epoch(epoch)  # a different shuffle each epoch
        total, count = 0.0, 0
        for data, label in trainloader:
            data, label = data.to(device), label.to(device)
            optimizer.zero_grad()
            loss = loss_func(model(data), label)
            loss.backward()
            optimizer.step()
            total, count = total + loss.item(), count + 1
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: mean loss {total / count:.3f}", flush=True)
            # DDP: save model.module (the wrapped model), once, on rank 0.
            torch.save(model.module.state_dict(), os.path.join(flags.ckpt_dir, f"{epoch}.ckpt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
