"""A 2-rank Job over a slow loop: its own progress bar on rank 0; MID-EPOCH printed halfway."""

import os
import time

import torch
from torch import nn

import phalanx

STEPS = 40


def main() -> None:
    job = phalanx.Job()
    net = nn.Linear(4, 2)
    model, optimizer = job.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert optimizer is not None
    for step, x in enumerate(job.progress(torch.randn(STEPS, 8, 4))):
        job.backward(model(x).pow(2).mean())
        job.step(optimizer)
        time.sleep(0.05)
        if step == STEPS // 2 and os.environ["RANK"] == "0":
            print("MID-EPOCH", flush=True)
    job.close()
    print("END", flush=True)


if __name__ == "__main__":
    main()
