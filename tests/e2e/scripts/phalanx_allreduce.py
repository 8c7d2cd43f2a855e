"""Join with ``phalanx.init_process_group()`` (whatever launched us), all_reduce over gloo, and
print the sum and the GLOO_SOCKET_IFNAME gloo ran with.

Usage: phalanx_allreduce.py TIMEOUT_S
"""

import os
import sys

import torch

import phalanx

torch.set_num_threads(1)
world = phalanx.init_process_group("gloo", timeout=float(sys.argv[1]))
t = torch.tensor([float(world.rank + 1)])
phalanx.all_reduce(t)
print(f"RANK {world.rank} SUM {t.item():g} IFNAME {os.environ.get('GLOO_SOCKET_IFNAME')}")
sys.stdout.flush()
phalanx.destroy_process_group()
