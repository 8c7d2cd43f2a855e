"""FSDP2 on a backend="shm" group, then DTensor's ``full_tensor()``, in a loop: the check for a
deadlock fixed in ``comm/shm/base.py`` (see docs/shm.md, "DTensor's functional collectives").

Before the fix, torch's functional collectives went to the group's gloo backend with the GIL
held, and beside CPU burners a run stalled until gloo's send timeout (20 s). Not in
``make test``. Run beside burners, e.g.
``for i in 1 2 3 4; do python -c 'while 1: pass' & done; python tools/shm_dtensor_stall.py 10``
(``... 10 gloo`` runs the same loop on gloo).
"""

import sys

import torch
import torch.distributed as dist
from torch import nn

from phalanx.testing import run_distributed

BACKEND = sys.argv[2] if len(sys.argv) > 2 else "shm"


def body(n: int) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    s: list[float] = []
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=g)).sum().backward()
        opt.step()
        s = [p.full_tensor().sum().item() for p in model.parameters()]  # type: ignore[attr-defined]
    return s


if __name__ == "__main__":
    for k in range(int(sys.argv[1])):
        run_distributed(body, 200, world_size=2, backend=BACKEND, timeout=60)
        print(k, "ok", flush=True)
