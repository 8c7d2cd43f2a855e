"""A DDP Job that checkpoints every epoch and reports its world size (elastic launcher test).

Usage: elastic_job.py CKPT_DIR
"""

import os
import sys
import time

import torch
from torch import nn

import phalanx

generation = int(os.environ["PHALANX_RESTART_COUNT"])
job = phalanx.Job(strategy="ddp", checkpoint_dir=sys.argv[1], seed=0)
if job.world.is_main:
    print(f"GEN {generation} WORLD {job.world.world_size}", flush=True)
g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 2, (64,)))
model = nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = job.setup(model, optimizer)
loader = job.loader(data, batch_size=8)
for _ in job.epochs(25):
    for x, y in job.progress(loader):
        job.backward(nn.functional.cross_entropy(model(x), y))
        job.step()
        if generation == 0:  # slow enough that the test's kill lands mid-training
            time.sleep(0.05)
    job.save()
if job.world.is_main:
    print(f"DONE WORLD {job.world.world_size} STEPS {job.step_count}", flush=True)
job.close()
