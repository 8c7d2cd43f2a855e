"""A Job that a test kills mid-epoch (SIGKILL on rank 1) and starts again; prints a digest.

Usage: resume_job.py CKPT_DIR [--kill-epoch E] [--kill-step S --kill-rank R --stamp FILE]

``--kill-step`` kills rank R before global step S on the first attempt only
(``PHALANX_RESTART_COUNT=0``), after writing the time to FILE, so that under
``phalanx run --max-restarts 1`` the restarted job resumes by itself; the first step after a
restart prints ``FIRST_STEP <time>``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import time

import torch
from torch import nn

import phalanx


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt")
    parser.add_argument("--kill-epoch", type=int, default=-1)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--stamp", default=None)
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    job = phalanx.Job(strategy="ddp", checkpoint_dir=args.ckpt, seed=3, grad_accum=2)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(200, 10, generator=g), torch.randint(0, 4, (200,), generator=g)
    )
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    model, optimizer = job.setup(model, optimizer, scheduler)
    loader = job.loader(data, batch_size=16, shuffle=True)
    attempt = int(os.environ.get("PHALANX_RESTART_COUNT", "0"))
    first = attempt > 0
    for epoch in job.epochs(args.epochs):
        losses = []
        for i, (x, y) in enumerate(job.progress(loader)):
            if epoch == args.kill_epoch and i == 3 and job.world.rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            kill = attempt == 0 and job.step_count == args.kill_step and i % 2 == 0
            if kill and job.world.rank == args.kill_rank:
                with open(args.stamp or os.devnull, "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            if first and job.world.is_main:
                print("FIRST_STEP", repr(time.time()), "step", job.step_count, flush=True)
                first = False
            loss = nn.functional.cross_entropy(model(x), y)
            job.backward(loss)
            job.step()
            losses.append(loss.item())
        job.log(loss=sum(losses) / len(losses), noise=torch.rand(1).item())
        job.save()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if job.world.is_main:
        print("DIGEST", hashlib.sha256(flat.numpy().tobytes()).hexdigest())
    job.close()


if __name__ == "__main__":
    main()
