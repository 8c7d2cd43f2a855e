"""Print the launcher's environment as JSON, then all_reduce with plain torch env:// init."""

import json
import os
import sys
from datetime import timedelta

NAMES = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "PHALANX_RUN_ID",
    "PHALANX_RESTART_COUNT",
    "PHALANX_BACKEND",
    "PYTHONUNBUFFERED",
    "OMP_NUM_THREADS",
    "GLOO_SOCKET_IFNAME",
]
print("ENV " + json.dumps({name: os.environ.get(name) for name in NAMES}))
print("ARGS " + json.dumps(sys.argv[1:]))
sys.stdout.flush()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=timedelta(seconds=30))
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"SUM {t.item():g}")
dist.destroy_process_group()
