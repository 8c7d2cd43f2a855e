"""Print the cores this worker may run on and its OpenMP threads, as one JSON line."""

import json
import os
import sys

import torch

seen = {
    "rank": os.environ["RANK"],
    "cores": sorted(os.sched_getaffinity(0)),
    "omp": os.environ.get("OMP_NUM_THREADS"),
    "torch_threads": torch.get_num_threads(),
    "bind_env_left": "PHALANX_BIND_CORES" in os.environ,
}
sys.stdout.write("CORES " + json.dumps(seen) + "\n")
sys.stdout.flush()
