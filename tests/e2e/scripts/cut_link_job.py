"""All-reduce once, then (once the file GO exists) again: a test cuts a host's link in between.

Usage: cut_link_job.py GO. Rank 0 prints READY after the first all-reduce; every rank prints
DONE <sum> after the second.
"""

import os
import sys
import time

import torch

import phalanx

torch.set_num_threads(1)
world = phalanx.init_process_group("gloo", timeout=600)
t = torch.ones(1)
phalanx.all_reduce(t)
if world.rank == 0:
    print("READY", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
phalanx.all_reduce(t)  # across the cut link: waits until the test mends it
print(f"DONE {t.item():g}", flush=True)
phalanx.destroy_process_group()
