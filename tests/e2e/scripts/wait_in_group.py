"""Join the process group, wait SECONDS, meet again and leave (a job to try to join by hand).

With a second argument, a path, the wait ends early once that file exists.
"""

import os
import sys
import time

import torch.distributed as dist

import phalanx

phalanx.init_process_group("gloo")
dist.barrier()
end = time.monotonic() + float(sys.argv[1])
stop = sys.argv[2] if len(sys.argv) > 2 else None
while time.monotonic() < end and not (stop and os.path.exists(stop)):
    time.sleep(0.05)
dist.barrier()
phalanx.destroy_process_group()
