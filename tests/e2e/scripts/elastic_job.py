"""A DDP Job that checkpoints in the middle of every epoch and reports its world size (the
multi-host tier's lost-host tests: a resume at another world size continues the epoch).

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
    for i, (x, y) in enumerate(job.progress(loader)):
        job.backward(nn.functional.cross_entropy(model(x), y))
        job.step()
        if i == 0:  # after the first of 2 (world 4) or 4 (world 2) steps: mid-epoch
            job.save()
        if generation == 0:  # slow enough that the test's kill lands mid-training
            time.sleep(0.05)
if job.world.is_main:
    print(f"DONE WORLD {job.world.world_size} STEPS {job.step_count}", flush=True)
job.close()
