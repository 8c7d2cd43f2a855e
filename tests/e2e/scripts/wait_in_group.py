"""Join the process group, wait SECONDS, meet again and leave (a job to try to join by hand)."""

import sys
import time

import torch.distributed as dist

import phalanx

phalanx.init_process_group("gloo")
dist.barrier()
time.sleep(float(sys.argv[1]))
dist.barrier()
phalanx.destroy_process_group()
