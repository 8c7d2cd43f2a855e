"""Join a gloo group (and a parameter server's gloo pairs), write this pid to DIR, then sleep."""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import phalanx

phalanx.init_process_group("gloo")
t = torch.ones(2)
dist.all_reduce(t)  # gloo pairs are connected lazily: make sure they exist
out = Path(sys.argv[1])
(out / f".{os.environ['RANK']}").write_text(str(os.getpid()))
os.replace(out / f".{os.environ['RANK']}", out / f"rank{os.environ['RANK']}")
time.sleep(60)
