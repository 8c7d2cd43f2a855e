"""A job for the shm stranger: groups, shared buffers and all-reduces with known results.

Usage: shm_stranger_job.py READY_FILE

Makes the default group (the launcher's backend), waits until the stranger says it watches the
store (READY_FILE exists), then makes three more groups of the same backend (on shm each with a
shared buffer) and all-reduces on each; rank 0 prints ``RESULT <sums>``.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

import phalanx

phalanx.init_process_group()
rank, size = dist.get_rank(), dist.get_world_size()
ready = sys.argv[1]
while not os.path.exists(ready):  # the stranger is watching the store from now on
    time.sleep(0.01)
backend = dist.get_backend()
sums = []
for _ in range(3):
    group = dist.new_group(backend=backend)
    t = torch.full((5,), float(rank + 1))
    if backend == "shm":
        from phalanx.comm.shm import shared_buffer

        buffer = shared_buffer(group, 5)
        buffer.copy_(t)
        dist.all_reduce(buffer, group=group)
        t = buffer.clone()
    dist.all_reduce(t, group=group)
    sums.append(t[0].item())
if rank == 0:
    print(f"RESULT {backend} {sums}", flush=True)
phalanx.destroy_process_group()
