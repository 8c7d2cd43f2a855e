"""First attempt: all_reduce, then rank 1 SIGKILLs itself. After a restart: all_reduce, exit 0."""

import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist

torch.set_num_threads(1)
attempt = int(os.environ["PHALANX_RESTART_COUNT"])
dist.init_process_group("gloo", timeout=timedelta(seconds=20))
rank = dist.get_rank()
t = torch.ones(4)
dist.all_reduce(t)
assert t[0].item() == dist.get_world_size()
if attempt == 0:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # the peer is gone: gloo raises within ~0.1 s
    raise SystemExit("rank 0 should not get past the barrier")
print(f"attempt {attempt}: rank {rank} all_reduce ok")
dist.destroy_process_group()
