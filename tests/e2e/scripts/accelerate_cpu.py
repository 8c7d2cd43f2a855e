"""An unchanged Accelerate training script: each rank (the launcher's RANK) trains on its own
data; prints what Accelerate saw and the weights it ended with."""

import json
import os

import torch
from accelerate import Accelerator

accelerator = Accelerator()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
x = torch.randn(8, 4, generator=torch.Generator().manual_seed(int(os.environ["RANK"])))
for _ in range(3):
    accelerator.backward(model(x).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
seen = {
    "index": accelerator.process_index,
    "processes": accelerator.num_processes,
    "type": str(accelerator.distributed_type),
    "weight": accelerator.unwrap_model(model).weight.detach().flatten().tolist(),
}
print("ACCELERATE " + json.dumps(seen), flush=True)
