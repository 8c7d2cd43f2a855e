"""A ``phalanx.Job`` under ``phalanx run --recovery live``; chosen ranks SIGKILL themselves.

argv: OUT KILLS [STEP_SLEEP_S [RECOVERY [STRATEGY]]]   (RECOVERY: Job's recovery=, default
"live"; STRATEGY: "ddp" (default), "zero2" or "zero3", or "zero2/K": ZeRO-2 whose shards are
mirrored every K steps, ``Zero(mirror_every=K)``)

KILLS is a comma-separated list of ``RANK@STEP`` (the first process of launcher rank RANK
SIGKILLs itself just before the forward of step STEP) or ``RANK@wSIZE`` (... of the first step
it trains in a generation of SIZE members) or ``RANK@start`` (before it makes its Job), or
``RANK@setup-stop`` (it SIGSTOPs itself inside ``job.setup``, before the setup's broadcast), or
``RANK@STEP@node``: that process SIGKILLs its launcher's process group (the node's agent; the
node's other workers die with it) and then itself, as if the machine vanished; "-" kills nobody.

Every process writes ``OUT/<member>.<incarnation>.json`` when it ends: its pid at start and
end, the job's membership changes, its committed steps, a SHA-256 of the final parameters (and
their values), the ledger's problems (an empty list: every sample exactly once per epoch), and
a tracked count of committed steps, received with the state (60 at the end on every member
when tracked objects travel and roll back right).
Under ZeRO the job also saves a checkpoint after every epoch into ``OUT/ckpt``, and the record
says at which steps the process called ``phalanx.checkpoint.load`` (a live recovery must not).

``LIVE_JOB_STRANGER=1``: before it makes its Job, the first process of rank 0 writes into the
worker store as a process without the job secret would (raw, unsigned): it bumps the old join
counter ``phalanx/live/joins``, puts junk at every slot's join record, and junk at torch's
rendezvous keys of generations 1 to 5 under their old, guessable names.

Each step sleeps STEP_SLEEP_S (default 0.05), and 1 s while a member is missing, so that a
replacement (which imports torch first: seconds on a loaded box) is admitted while the others
still train. ``LIVE_JOB_EXCHANGE_DELAY_S`` delays every ZeRO mirror exchange by that long, so
that one is always in flight when a member is lost or admitted.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from live_record import live_record, publish  # this folder is on sys.path
from torch import nn
from torch.utils.data import TensorDataset

import phalanx
from phalanx.recovery import shard_mirror

out, kills = Path(sys.argv[1]), [k.split("@") for k in sys.argv[2].split(",") if k != "-"]
pause = float(sys.argv[3]) if len(sys.argv) > 3 else 0.05
recovery = sys.argv[4] if len(sys.argv) > 4 else "live"
strategy = sys.argv[5] if len(sys.argv) > 5 else "ddp"
member, incarnation = os.environ["PHALANX_MEMBER_ID"], int(os.environ["PHALANX_INCARNATION"])
started_pid = os.getpid()
torch.set_num_threads(1)

if incarnation == 0 and [os.environ["RANK"], "start"] in kills:  # before it joins the job
    os.kill(os.getpid(), signal.SIGKILL)
if incarnation == 0 and os.environ["RANK"] == "0" and os.environ.get("LIVE_JOB_STRANGER"):
    from datetime import timedelta

    import torch.distributed as dist

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    raw = dist.TCPStore(addr, port, None, False, timedelta(seconds=30))  # no secret, no frames
    raw.add("phalanx/live/joins", 5)
    for r in range(4):
        raw.set(f"phalanx/live/join/0.{r}", "junk")
        for k in range(1, 6):
            raw.set(f"phalanx/live/g{k}/pg//0//cpu//0/{r}", b"\xff" * 64)  # type: ignore[arg-type]
if incarnation == 0 and [os.environ["RANK"], "setup-stop"] in kills:
    import phalanx.train.live as live_training

    real_broadcast = live_training.broadcast_coalesced

    def stopped_broadcast(*args: object) -> object:
        os.kill(os.getpid(), signal.SIGSTOP)  # a hung worker: its heartbeat stops too
        return real_broadcast(*args)  # type: ignore[arg-type]

    live_training.broadcast_coalesced = stopped_broadcast  # type: ignore[assignment]
sharded = strategy != "ddp"
stage, _, every = strategy.partition("/")
chosen = phalanx.Zero(stage=int(stage[-1]), mirror_every=int(every)) if every else strategy
job = phalanx.Job(
    chosen, seed=0, recovery=recovery, checkpoint_dir=out / "ckpt" if sharded else None
)
loads: list[int] = []  # the step count at each checkpoint read
real_load = phalanx.checkpoint.load


def spied_load(*args: object, **kwargs: object) -> object:
    loads.append(job.step_count)
    return real_load(*args, **kwargs)  # type: ignore[arg-type]


phalanx.checkpoint.load = spied_load  # type: ignore[assignment]
exchange_delay = float(os.environ.get("LIVE_JOB_EXCHANGE_DELAY_S", "0"))
real_exchange = shard_mirror._exchange


def slow_exchange(*args: object) -> object:
    time.sleep(exchange_delay)
    return real_exchange(*args)  # type: ignore[arg-type]


if exchange_delay:
    shard_mirror._exchange = slow_exchange  # type: ignore[assignment]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model, optimizer = job.setup(model, optimizer, loss_fn=F.cross_entropy)


class Steps:
    """A tracked count of committed steps: a replacement receives it, a rollback resets it."""

    n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


steps = job.track("steps", Steps())  # after setup: a replacement has its state by then
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(480, 8, generator=g), torch.randint(4, (480,), generator=g))
loader = job.loader(data, batch_size=6)  # 24 samples a step at 4 ranks: 20 steps an epoch

for _epoch in job.epochs(3):
    for x, y in job.progress(loader):
        for rank, when, *node in kills if incarnation == 0 else []:
            now = f"w{job.world.world_size}" if when[0] == "w" else str(job.step_count)
            if rank == os.environ["RANK"] and when == now:
                if node:  # the whole machine: its agent's group, then this process
                    os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
        if strategy == "zero3":  # its forward communicates: the job guards it
            loss = job.forward_backward(x, y)
        else:
            loss = F.cross_entropy(model(x), y)
            job.backward(loss)
        if job.step():
            steps.n += 1
        # Slower while a member is missing, so that its replacement (which imports torch
        # first) is admitted before the end whatever the load.
        time.sleep(pause if job.world.world_size == 4 else 1.0)
    job.log(loss=float(loss.detach()))
    if sharded:
        job.save()

if strategy == "zero3":
    full = model.full_state_dict(rank0_only=False)  # type: ignore[operator]
    params = torch.cat([v.reshape(-1) for v in full.values()])
else:
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
assert job.live is not None and job.live.ledger is not None
record = {
    **live_record(job, params, started_pid),
    "epochs": job.live.ledger.epochs,
    "loads": loads,
    "tracked_steps": steps.n,
}
job.close()
publish(out / f"{member}.{incarnation}.json", record)
