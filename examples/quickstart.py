"""A data-parallel training job that resumes from its newest checkpoint (the README's Quick start).

phalanx run --standalone --nproc-per-node 2 examples/quickstart.py   # trains
phalanx run --standalone --nproc-per-node 2 examples/quickstart.py   # resumes: nothing left
"""

import torch
from torch import nn

import phalanx

dataset = torch.utils.data.TensorDataset(torch.randn(1024, 16), torch.randn(1024, 1))
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

with phalanx.Job(phalanx.DDP(), precision="bf16-mixed", grad_accum=4, checkpoint_dir="ckpt") as job:
    model, optimizer = job.setup(model, optimizer)
    for _ in job.epochs(10):  # resumes from the newest checkpoint
        loader = job.loader(dataset, batch_size=64, shuffle=True)  # here or before the loop
        for x, y in job.progress(loader):  # tqdm on rank 0
            loss = nn.functional.mse_loss(model(x), y)
            job.backward(loss)  # syncs only on the last accumulation micro-step
            job.step()  # the optimizer given to setup(), at the end of each window of 4
        job.log(loss=loss.item())  # averaged over ranks, JSONL on rank 0
        job.save()  # atomic, pickle-free, written in the background
