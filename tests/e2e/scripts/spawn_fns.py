"""Functions run by phalanx.spawn in the e2e tests (module level: the children import them)."""

import os
import time
from datetime import timedelta


def all_reduce_to_file(rank: int, out_dir: str) -> None:
    """init_process_group('gloo') with env://, all_reduce rank + 1, write the sum to a file."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{t.item():g} {dist.get_world_size()} {os.environ['LOCAL_RANK']}")
    dist.destroy_process_group()


def rank1_raises(rank: int) -> None:
    """Rank 1 raises ValueError('boom'); the others sleep (they must be stopped)."""
    if rank == 1:
        raise ValueError("boom")
    time.sleep(60)
