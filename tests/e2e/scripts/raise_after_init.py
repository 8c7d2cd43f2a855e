"""After init_process_group (which installs torch's "[rankN]:" excepthook), rank 1 raises."""

import os
from datetime import timedelta

import torch.distributed as dist

dist.init_process_group("gloo", timeout=timedelta(seconds=30))
if os.environ["RANK"] == "1":
    raise ValueError("boom after init")
dist.barrier()
