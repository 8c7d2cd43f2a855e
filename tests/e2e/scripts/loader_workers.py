"""Each rank iterates DataLoaders with forked workers (new ones each epoch) between collectives."""

import time

import torch

import phalanx

phalanx.init_process_group()
data = torch.utils.data.TensorDataset(torch.arange(64.0))
total = torch.zeros(1)
for epoch in range(3):
    loader = torch.utils.data.DataLoader(data, batch_size=8, num_workers=2)
    for (batch,) in loader:
        total += batch.sum()
    phalanx.all_reduce(total)
    time.sleep(0.3 * epoch)  # forks land at different points of the progress thread's tick
if torch.distributed.get_rank() == 0:
    print(f"loader workers ok {int(total.item())}", flush=True)
phalanx.destroy_process_group()
