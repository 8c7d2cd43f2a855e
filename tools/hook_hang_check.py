"""A healthy 2-rank DDP job with fp16_compress_hook for 10 s: it must print no hang report.

    PHALANX_HANG_TIMEOUT=3 phalanx run --standalone --nproc-per-node 2 tools/hook_hang_check.py

Before collectives consumed through ``get_future()`` were marked complete, this printed a false
"hang report" every few seconds (4 in 10 s on a 2-core machine). Count them with
``... 2>&1 | grep -c "hang report"``.
"""

import time

import torch

import phalanx
from phalanx.data_parallel.hooks import fp16_compress_hook

SECONDS = 10.0

phalanx.init_process_group("gloo")
model = phalanx.DistributedDataParallel(torch.nn.Linear(256, 256))
model.register_comm_hook(None, fp16_compress_hook)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
end, steps = time.monotonic() + SECONDS, 0
while time.monotonic() < end:
    optimizer.zero_grad()
    model(torch.randn(32, 256)).sum().backward()
    optimizer.step()
    steps += 1
    time.sleep(0.05)
print(f"steps {steps}", flush=True)
phalanx.destroy_process_group()
