"""A Job loop that ends the ways scripts end: without close(), or by a scheduler's SIGTERM.

Usage: loop_exit.py CKPT EPOCHS [--stamp FILE --stamp-step N]. Saves asynchronously after
every epoch and never calls ``job.close()``. With ``--stamp``, rank 0 writes FILE once step N is
done (the test then sends SIGTERM) and each step after it takes 20 ms, so a preempted run stops
long before its (huge) EPOCHS. A tracked counter counts the steps after ``job.step()``, so a
preempted save that missed the loop body after its step shows in the digest. Rank 0 prints
``DIGEST <sha256 of the parameters and the counter>`` at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from pathlib import Path

import torch
from torch import nn

import phalanx

parser = argparse.ArgumentParser()
parser.add_argument("ckpt")
parser.add_argument("epochs", type=int)
parser.add_argument("--stamp")
parser.add_argument("--stamp-step", type=int, default=0)
args = parser.parse_args()

g = torch.Generator().manual_seed(0)
dataset = torch.utils.data.TensorDataset(
    torch.randn(256, 8, generator=g), torch.randn(256, 1, generator=g)
)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


job = phalanx.Job("ddp", checkpoint_dir=args.ckpt, keep_last=2)
model, optimizer = job.setup(model, optimizer)
counter = job.track("counter", Counter())
for _epoch in job.epochs(args.epochs):
    for x, y in job.progress(job.loader(dataset, batch_size=16, shuffle=True)):
        job.backward(nn.functional.mse_loss(model(x), y))
        job.step(optimizer)
        counter.n += 1  # the loop body after job.step() belongs to the step
        if args.stamp and job.step_count >= args.stamp_step:
            if job.world.is_main and job.step_count == args.stamp_step:
                Path(args.stamp).write_text(str(job.step_count))
            time.sleep(0.02)  # pacing only: the test waits on the stamp, not on time
    job.save()
if job.world.is_main:
    weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    digest = hashlib.sha256(weights + str(counter.n).encode())
    print("DIGEST", digest.hexdigest(), flush=True)
