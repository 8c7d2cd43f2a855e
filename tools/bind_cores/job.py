"""A compute-bound 2-rank DDP job for ``bench.py``: prints its median step time (rank 0)."""

import statistics
import time

import torch
from torch import nn

import phalanx

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512))
data = [torch.randn(128, 512) for _ in range(4)]
with phalanx.Job("ddp") as job:
    model, optimizer = job.setup(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    times = []
    for step in range(40):
        start = time.perf_counter()
        job.backward(model(data[step % 4]).square().mean())
        job.step()
        times.append(time.perf_counter() - start)
    if job.world.rank == 0:
        print(f"STEP_MS {1e3 * statistics.median(times[10:]):.3f}", flush=True)
