"""A short ``phalanx.Job`` whose final parameters rank 0 writes to a file (parity tests).

Usage: train_digest.py STRATEGY OUT   (STRATEGY: "ddp", "zero2" or "zero3")

A 2-layer MLP trains 2 epochs of 16 steps (global batch 16) on fixed random data, seed 0; rank
0 writes ``OUT`` as JSON: the world size, the step count and the full parameters (gathered
under ZeRO-3), so that runs at any world, on any number of hosts, can be compared.
"""

import json
import sys
from pathlib import Path

import torch
from torch import nn

import phalanx

strategy, out = sys.argv[1], Path(sys.argv[2])
torch.set_num_threads(1)
job = phalanx.Job(strategy, seed=0)
g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(
    torch.randn(256, 16, generator=g), torch.randn(256, 4, generator=g)
)
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
model, optimizer = job.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
loader = job.loader(data, batch_size=16 // job.world.world_size)
for _ in job.epochs(2):
    for x, y in loader:
        job.backward(nn.functional.mse_loss(model(x), y))
        job.step()
if strategy == "zero3":
    full = model.full_state_dict(rank0_only=False)  # type: ignore[operator]
else:
    full = {k: v.detach() for k, v in model.state_dict().items()}
if job.world.is_main:
    params = {k.removeprefix("module."): v.reshape(-1).tolist() for k, v in full.items()}
    record = {"world": job.world.world_size, "steps": job.step_count, "params": params}
    out.write_text(json.dumps(record))
job.close()
