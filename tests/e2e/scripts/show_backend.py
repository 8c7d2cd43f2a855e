"""Join with phalanx's defaults, all_reduce, and print the backend that carried it."""

import torch

import phalanx

world = phalanx.init_process_group()
t = torch.ones(3)
phalanx.all_reduce(t)
print(f"BACKEND {world.backend} SUM {int(t[0])}", flush=True)
phalanx.destroy_process_group()
