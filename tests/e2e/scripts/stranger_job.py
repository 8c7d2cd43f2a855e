"""A checkpointed Job with one real hang at the end, for the stranger test; prints a digest.

Usage: stranger_job.py CKPT_DIR EPOCHS

With ``WAIT_FOR_STRANGER=1`` every rank first waits (up to 120 s) for the stranger's
``stranger/connected`` key in the worker store, so that the saves it forges answers for come after
it connected, however slowly the machine started it. Each epoch is saved; after training rank 1
is late for one all-reduce (longer than ``PHALANX_HANG_TIMEOUT``), so every rank prints a live
hang report, then the job ends normally.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from datetime import timedelta

import torch
from torch import nn

import phalanx
from phalanx.comm.group import signed_store


def late_for_the_all_reduce() -> None:
    time.sleep(5.0)


def main() -> None:
    ckpt, epochs = sys.argv[1], int(sys.argv[2])
    torch.use_deterministic_algorithms(True)
    job = phalanx.Job(strategy="ddp", checkpoint_dir=ckpt, seed=3)
    g = torch.Generator().manual_seed(0)
    x_all, y_all = torch.randn(96, 10, generator=g), torch.randint(0, 4, (96,), generator=g)
    data = torch.utils.data.TensorDataset(x_all, y_all)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 4))
    model, _ = job.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    loader = job.loader(data, batch_size=16, shuffle=True)
    if os.environ.get("WAIT_FOR_STRANGER"):  # every rank: none sits in a collective meanwhile
        store = signed_store().store  # type: ignore[union-attr]
        store.wait(["stranger/connected"], timedelta(seconds=120))
    for _ in job.epochs(epochs):
        for x, y in job.progress(loader):
            job.backward(nn.functional.cross_entropy(model(x), y))
            job.step()
        job.save()
    t = torch.ones(2)
    if job.world.rank == 1:
        late_for_the_all_reduce()
    phalanx.all_reduce(t)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if job.world.is_main:
        print("DIGEST", hashlib.sha256(flat.numpy().tobytes()).hexdigest(), flush=True)
    job.close()


if __name__ == "__main__":
    main()
