"""A 2-rank ZeRO-1 Job with ``checkpoint_dir``, for the no-extras smoke (``smoke.py``).

Usage: ``phalanx run --nproc-per-node 2 job.py CKPT EPOCHS``. Run it again with more epochs and it
resumes: the optimizer state comes back from per-rank pieces (memory-mapped safetensors files,
read without the safetensors library).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import phalanx


def main() -> None:
    ckpt, epochs = sys.argv[1], int(sys.argv[2])
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)
    )
    with phalanx.Job(strategy="zero1", checkpoint_dir=ckpt, seed=1) as job:
        net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        model, _ = job.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        loader = job.loader(data, batch_size=8, shuffle=True)
        for _ in job.epochs(epochs):
            for x, y in job.progress(loader):
                loss = nn.functional.cross_entropy(model(x), y)
                job.backward(loss)
                job.step()
            job.log(loss=loss.item())
            job.save()


if __name__ == "__main__":
    main()
