"""The training script ``plant_and_catch`` verifies: an unchanged ``phalanx.Job`` loop.

A small classifier on scikit-learn's digits with dropout, a fixed random projection kept as a
buffer, AdamW, an exponential LR schedule and a checkpoint directory. Each rank seeds its
generator with its rank before building the model (as scripts that want different dropout per
rank do): the strategy's start-up broadcast makes the ranks' parameters and buffers equal.

    phalanx run --standalone --nproc-per-node 2 train.py [--dropout 0.1] [--grad-accum 1]

With ``PHALANX_PLANT=<name>`` in its environment it plants that bug first (``plants.py``).
"""

import argparse
import os

import plants  # this folder is the script's, first on sys.path
import torch
from torch import nn

import phalanx

parser = argparse.ArgumentParser()
parser.add_argument("--dropout", type=float, default=0.1)
parser.add_argument("--grad-accum", type=int, default=1)
parser.add_argument("--checkpoint-dir", default="plant-ckpt")
parser.add_argument("--seed", type=int, default=0, help="the ranks' model seeds: 100*seed+rank")
args = parser.parse_args()
plants.install(os.environ.get(plants.ENV, ""))


class Net(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.register_buffer("projection", torch.randn(64, 64) / 8)
        self.body = nn.Sequential(
            nn.Linear(64, 64), nn.ReLU(), nn.Dropout(dropout), nn.Linear(64, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x @ self.projection)


pixels, labels = phalanx.datasets.digits()  # phalanx verify starts 8 of these per verification
x = torch.tensor(pixels, dtype=torch.float32) / 16
y = torch.tensor(labels)
dataset = torch.utils.data.TensorDataset(x, y)
torch.manual_seed(100 * args.seed + int(os.environ.get("RANK", "0")))
model = Net(args.dropout)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.95)

with phalanx.Job("ddp", grad_accum=args.grad_accum, checkpoint_dir=args.checkpoint_dir) as job:
    trained, _stepped = job.setup(model, optimizer, scheduler=scheduler)
    for _ in job.epochs(3):
        loader = job.loader(dataset, batch_size=32, shuffle=True)
        for xb, yb in loader:
            loss = nn.functional.cross_entropy(trained(xb), yb)
            job.backward(loss)
            job.step()
        job.save()
