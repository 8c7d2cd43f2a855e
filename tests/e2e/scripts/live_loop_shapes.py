"""A ``phalanx.Job`` under ``phalanx run --recovery live``, its loop written as users write it.

argv: OUT LOOP LOADER KILLS RECOVERY [MODE]

- LOOP: "progress" (``for x, y in job.progress(loader)``) or "plain" (``for x, y in loader``);
- LOADER: "inside" (``job.loader(...)`` made again at the top of every epoch) or "once" (before
  the epoch loop);
- KILLS: "-" or ``RANK@STEP``: the first process of launcher rank RANK SIGKILLs itself just
  before the forward of step STEP;
- RECOVERY: ``Job(recovery=...)``, "live" or "live-exact";
- MODE: "late": a replacement waits, before it makes its Job, until every first process of the
  other slots has written its record (the others finished training), and those never call
  ``job.close()``, so only the launcher can tell the replacement that the job is over;
  "epoch1": a replacement waits, before it makes its Job, until rank 0 has started epoch 1
  (the file ``OUT/epoch-1``), and steps of epoch 1 take 0.5 s while a member is missing, so
  that it joins in epoch 1; "workers": the loader is made with ``num_workers=2`` (refused by a
  live job).

DDP over 4 ranks (or as many as launched), 2 epochs of 30 steps (480 samples, 16 a step at 4
ranks), each step sleeping 0.02 s. Every process that trains writes ``OUT/<member>.<incarnation>
.json`` when it ends: its pid at start and end, its committed steps, the epochs its loop saw,
how many of its ``job.step()`` calls stepped, the ledger's problems and epochs, and the final
parameters (values and SHA-256). A replacement writes ``OUT/<member>.<incarnation>.arrived``
before it makes its Job.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from live_record import live_record, publish  # this folder is on sys.path
from torch import nn
from torch.utils.data import TensorDataset

import phalanx

out, loop, made, kills, recovery = sys.argv[1:6]
mode = sys.argv[6] if len(sys.argv) > 6 else ""
folder = Path(out)
member, incarnation = os.environ["PHALANX_MEMBER_ID"], int(os.environ["PHALANX_INCARNATION"])
launched = int(os.environ["WORLD_SIZE"])
started_pid = os.getpid()
victim, _, at = kills.partition("@")
torch.set_num_threads(1)


def wait_for(names: list[str]) -> None:
    """Wait until the files ``names`` exist in OUT (the others wrote them)."""
    deadline = time.monotonic() + 60
    while not all((folder / name).exists() for name in names):
        if time.monotonic() > deadline:
            raise SystemExit(f"{names} did not appear within 60 s")
        time.sleep(0.05)


if incarnation > 0:
    (folder / f"{member}.{incarnation}.arrived").write_text(str(os.getpid()))
    if mode == "late":  # until the first process of every other slot wrote its record
        wait_for([f"0.{r}.0.json" for r in range(launched) if f"0.{r}" != member])
    if mode == "epoch1":
        wait_for(["epoch-1"])
job = phalanx.Job("ddp", seed=0, recovery=recovery)
torch.manual_seed(0)
model: nn.Module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
model, _optimizer = job.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(480, 8, generator=g), torch.randint(4, (480,), generator=g))
options: dict[str, Any] = {"num_workers": 2} if mode == "workers" else {}


def make_loader() -> torch.utils.data.DataLoader[object]:
    return job.loader(data, batch_size=4, shuffle=True, **options)  # 16 a step at 4 ranks


loader = make_loader() if made == "once" else None
epochs, stepped = [], 0
for epoch in job.epochs(2):
    epochs.append(epoch)
    if epoch == 1 and member == "0.0":
        (folder / "epoch-1").write_text("")
    if made == "inside":
        loader = make_loader()
    assert loader is not None
    batches: Iterable[Any] = job.progress(loader) if loop == "progress" else loader
    for x, y in batches:
        if incarnation == 0 and os.environ["RANK"] == victim and str(job.step_count) == at:
            os.kill(os.getpid(), signal.SIGKILL)
        job.backward(F.cross_entropy(model(x), y))
        stepped += job.step()
        missing = job.world.world_size < launched
        time.sleep(0.5 if mode == "epoch1" and epoch == 1 and missing else 0.02)

params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
record = {**live_record(job, params, started_pid), "epochs": epochs, "stepped": stepped}
if mode != "late":  # late: only the launcher's finish marker tells the waiting replacement
    job.close()
publish(folder / f"{member}.{incarnation}.json", record)
