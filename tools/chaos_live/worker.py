"""The job of ``tools/chaos_live/run.py``: a live ``phalanx.Job`` that kills itself on cue.

argv: OUT RECOVERY STRATEGY KILL [REPLACED]

RECOVERY is the Job's ``recovery=`` ("live" or "live-exact"), STRATEGY a preset ("ddp" or
"zero2"), KILL
``RANK:STEP:PHASE`` or "-": the first process of launcher rank RANK SIGKILLs itself in step
STEP at PHASE, one of

- ``forward``: as the model's forward starts;
- ``backward``: as the backward reaches the last layer (the first gradients);
- ``allreduce``: as DDP hands its first bucket to the communication hook (plain DDP only);
- ``optimizer``: as the optimizer starts its step (the others' all-reduce is complete);
- ``save``: inside ``job.save()``, while the checkpoint is written (one every 5 steps; STEP is
  rounded up to one);
- ``random``: at a random moment up to 0.2 s into step STEP (a thread).

REPLACED ("1"; default "0") says the launcher replaces the victim: while the membership is
short the steps then take 1 s, so that the replacement (which imports torch first: seconds on a
loaded box) joins before the others finish.

Before it dies the victim writes ``OUT/kill.json`` (the wall-clock time, its generation).
Every process appends ``step time generation`` to ``OUT/<member>.<incarnation>.steps`` as each
step commits, and writes
``OUT/<member>.<incarnation>.json`` at the end: pids, steps, membership changes, the digest
and values of the final parameters, and the ledger's problems.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.utils.data import TensorDataset

import phalanx

out, recovery, strategy, kill = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
replaced = len(sys.argv) > 5 and sys.argv[5] == "1"
launched = int(os.environ["WORLD_SIZE"])
member, incarnation = os.environ["PHALANX_MEMBER_ID"], int(os.environ["PHALANX_INCARNATION"])
victim, kill_step, phase = (-1, -1, "") if kill == "-" else kill.split(":")
armed = incarnation == 0 and os.environ["RANK"] == str(victim)
kill_step = int(kill_step)
started_pid = os.getpid()
torch.set_num_threads(1)


def die() -> None:
    assert job.live is not None
    generation = job.live.group.generation
    record = {"time": time.time(), "member": member, "generation": generation}
    (out / "kill.json").write_text(json.dumps(record))
    os.kill(os.getpid(), signal.SIGKILL)


def cue(name: str) -> None:
    if armed and phase == name and job.step_count == kill_step:
        die()


job = phalanx.Job(strategy, seed=0, recovery=recovery, checkpoint_dir=out / "ckpt")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
model.register_forward_pre_hook(lambda *_: cue("forward"))
model[-1].weight.register_hook(lambda g: cue("backward"))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
model, optimizer = job.setup(model, optimizer)
assert optimizer is not None
optimizer.register_step_pre_hook(lambda *_: cue("optimizer"))  # ZeRO's own optimizer
if recovery == "live" and hasattr(model, "register_comm_hook"):

    def hook(state: Any, bucket: Any) -> Any:
        cue("allreduce")
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, hook)


class SaveCue:
    """A tracked object; ``job.save()`` reads its state twice: when it checks the tracked
    objects, then while the checkpoint is written (after the ranks met): the kill is there."""

    reads = 0

    def state_dict(self) -> dict[str, int]:
        self.reads += 1
        if self.reads == 2:
            cue("save")
        return {"n": 1}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


save_cue = job.track("save_cue", SaveCue())
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(640, 32, generator=g), torch.randint(8, (640,), generator=g))
loader = job.loader(data, batch_size=8)  # 32 samples a step at 4 ranks: 20 steps an epoch
steps_file = out / f"{member}.{incarnation}.steps"
if phase == "save":
    kill_step = -(-kill_step // 5) * 5

for _epoch in job.epochs(2):
    for x, y in job.progress(loader):
        if armed and phase == "random" and job.step_count == kill_step:
            threading.Timer(random.uniform(0, 0.2), die).start()
        loss = F.cross_entropy(model(x), y)
        job.backward(loss)
        if job.step():
            assert job.live is not None
            with steps_file.open("a") as f:
                f.write(f"{job.step_count} {time.time()} {job.live.group.generation}\n")
            # After a committed step only (a failed step is redone at once), and as long as
            # before the save (a loss inside it is redone at once too).
            pause = 1.0 if replaced and job.world.world_size < launched else 0.02
            if job.step_count % 5 == 0:
                save_cue.reads = 0
                job.save()
            time.sleep(pause)

params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
assert job.live is not None and job.live.ledger is not None
record = {
    "pid": os.getpid(),
    "started_pid": started_pid,
    "step": job.step_count,
    "world_size": job.world.world_size,
    "regroups": [[r.kind, r.world_size, r.step, r.seconds] for r in job.live.regroups],
    "digest": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
    "params": params.tolist(),
    "problems": job.live.ledger.problems(),
}
job.close()
(out / f"{member}.{incarnation}.json").write_text(json.dumps(record))
