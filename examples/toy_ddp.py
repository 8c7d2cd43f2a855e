"""Seed 001's torchrun ToyModel script, with one import line changed to use phalanx's DDP.

    phalanx run --standalone --nproc-per-node 2 examples/toy_ddp.py

The seed targets GPUs (NCCL, ``.cuda(local_rank)``); this port picks the device so that it also
runs on a CPU-only machine with gloo. Everything else is the seed's code.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim

from phalanx import DistributedDataParallel as DDP  # was: from torch.nn.parallel import ...

USE_CUDA = torch.cuda.is_available()


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def train() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    rank = int(os.environ["RANK"])
    print(f"[{os.getpid()}] (rank = {rank}, local_rank = {local_rank}) training...")
    device = torch.device("cuda", local_rank) if USE_CUDA else torch.device("cpu")

    model = ToyModel().to(device)
    ddp_model = DDP(model, [local_rank] if USE_CUDA else None)

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10).to(device))
    labels = torch.randn(20, 5).to(device)
    loss = loss_fn(outputs, labels)

    loss.backward()
    optimizer.step()

    print(f"[{os.getpid()}] (rank = {rank}, local_rank = {local_rank}) loss = {loss.item()}")


def run() -> None:
    keys = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    env_dict = {key: os.environ[key] for key in keys}
    print(f"[{os.getpid()}] Initializing process group with: {env_dict}")
    dist.init_process_group(backend="nccl" if USE_CUDA else "gloo")
    train()
    dist.destroy_process_group()


if __name__ == "__main__":
    run()
