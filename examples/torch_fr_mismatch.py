"""A pure torch job (no phalanx in it) whose ranks issue different collectives, read afterwards
by ``phalanx diagnose`` from torch's Flight Recorder dumps.

Rank 0 issues one all-reduce more than rank 1 (``log_metrics``, inside ``if rank == 0:``). The
all-reduces still pair up, so nothing fails until the ranks reach different ops, two collectives
later; then gloo times out (``--timeout``, 2 s). Each rank dumps torch's trace on the way out,
as torch's NCCL backend does by itself on a timeout (gloo does not), to
``$TORCH_FR_DUMP_TEMP_FILE<rank>``:

    TORCH_FR_BUFFER_SIZE=2000 TORCH_FR_DUMP_TEMP_FILE=$PWD/fr/trace_ \\
        torchrun --standalone --nproc-per-node 2 examples/torch_fr_mismatch.py
    phalanx diagnose fr/

``phalanx diagnose`` names collective #2 of the group and both call sites. ``--mode ok`` runs
the same job without the extra all-reduce; ``--json-prefix P`` also writes torch's JSON form
(which has no stacks) to ``P<rank>``. Started by hand instead of by a launcher:
``--init-method file:///tmp/x --rank R --world-size 2``.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace, _dump_fr_trace_json


def log_metrics(t: torch.Tensor, group: dist.ProcessGroup) -> None:
    dist.all_reduce(t, group=group)  # only rank 0 calls this: the bug


def train_step(t: torch.Tensor, group: dist.ProcessGroup) -> None:
    dist.all_reduce(t, group=group)


def dump(rank: int, json_prefix: str | None) -> None:
    """Write this rank's Flight Recorder trace where torch's own dump on timeout would go."""
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE", "/tmp/nccl_trace_rank_")
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    with open(f"{prefix}{rank}", "wb") as f:
        f.write(_dump_fr_trace())  # a pickle with each collective's Python stack
    if json_prefix:
        with open(f"{json_prefix}{rank}", "wb") as f:
            f.write(_dump_fr_trace_json())


def train(rank: int, mode: str, timeout: float) -> None:
    # the rendezvous keeps the default timeout (ranks may start seconds apart); the collectives
    # run on a group with a short one
    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout))
    t = torch.ones(4, 2)
    for step in range(3):
        if mode == "skip" and rank == 0 and step == 1:
            log_metrics(t, group)
        train_step(t, group)
    dist.broadcast(torch.zeros(3, dtype=torch.int64), src=0, group=group)
    dist.barrier(group=group)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("skip", "ok"), default="skip")
    parser.add_argument("--timeout", type=float, default=2.0, help="collective timeout, s")
    parser.add_argument("--json-prefix", default=None, help="also write the JSON dump here")
    parser.add_argument("--init-method", default="env://")
    parser.add_argument("--rank", type=int, default=-1)
    parser.add_argument("--world-size", type=int, default=-1)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=args.init_method, rank=args.rank, world_size=args.world_size
    )
    rank = dist.get_rank()
    try:
        train(rank, args.mode, args.timeout)
    finally:
        dump(rank, args.json_prefix)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
