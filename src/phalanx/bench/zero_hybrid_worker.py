"""One rank of ``phalanx bench zero_hybrid``: every implementation, interleaved, on this rank.

Started by the benchmark under ``phalanx run`` on each namespace host (``python -m
phalanx.bench.zero_hybrid_worker OUT_DIR [--impls ...] [--iters N] ...``). The model is ``phalanx
bench zero``'s char GPT (4 blocks, width 128, ~0.82 M parameters, AdamW; one unit per block).
Implementations (:data:`IMPLS`):

- ``hybrid3``: phalanx ``FullyShardedDataParallel`` sharded over this host's ranks and
  replicated across hosts (``Zero(stage=3, shard="host")``'s groups: shm inside, gloo across);
- ``zero3``: the same over every rank (plain ZeRO-3 over the default group);
- ``ddp``: phalanx ``DistributedDataParallel`` over every rank;
- ``torch-hsdp``: torch's HSDP, FSDP2 ``fully_shard`` on a 2-D ``DeviceMesh`` (replicate across
  hosts, shard inside) made from the default group's backend;
- ``torch-fsdp``: ``fully_shard`` over every rank (torch's ZeRO-3), ``hybrid2``: phalanx ZeRO-2
  with the hybrid groups (only when asked for).

First, one implementation at a time: the bytes this host sent over its link per step (its
``eth0`` counter, read by the host's first rank between barriers, over ``--byte-steps`` steps;
the link carries only traffic between hosts) and the bytes this rank handed to collectives
(``phalanx.comm_stats``). Then ``--iters`` rounds, each timing one step of every implementation
in rotating order (``bench.common.timed``: the slowest rank's time). Each rank writes
``OUT_DIR/rank<r>.json``. ``--world-backend`` chooses the default group's backend (``auto``:
what ``phalanx run`` gives; ``shm`` across hosts is hierarchical: shared memory inside each
host, gloo between them), which ``zero3``, ``ddp`` and the torch implementations run on.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import phalanx
from phalanx.bench.common import timed
from phalanx.bench.low_bandwidth_worker import link_tx_bytes
from phalanx.bench.zero import char_batch, char_gpt, state_bytes, train_step

__all__ = ["DEFAULT", "IMPLS", "main"]

IMPLS = ("hybrid3", "zero3", "ddp", "torch-hsdp", "torch-fsdp", "hybrid2")
DEFAULT = ("hybrid3", "zero3", "ddp", "torch-hsdp")

Built = tuple[nn.Module, torch.optim.Optimizer]


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)


def _phalanx(impl: str, hybrid: Any) -> Built:
    from phalanx.sharding import ZeroRedundancyOptimizer
    from phalanx.sharding.zero3 import FullyShardedDataParallel

    model = char_gpt()
    if impl == "ddp":
        ddp = phalanx.DistributedDataParallel(model)
        return ddp, _adamw(ddp.parameters())
    if impl == "hybrid2":
        opt = ZeroRedundancyOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            parameters_as_bucket_view=True,
            stage=2,
            process_group=hybrid.shard,
            replicate_group=hybrid.replicate,
            lr=3e-3,
            weight_decay=0.1,
        )
        return model, opt
    blocks = set(getattr(model, "blocks"))  # noqa: B009
    groups = {"process_group": hybrid.shard, "replicate_group": hybrid.replicate}
    fsdp = FullyShardedDataParallel(
        model, wrap=lambda m: m in blocks, **(groups if impl == "hybrid3" else {})
    )
    return fsdp, _adamw(fsdp.parameters())


def _torch(impl: str, hosts: int, per_host: int) -> Built:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = char_gpt()
    mesh = None
    if impl == "torch-hsdp":  # ranks are numbered host by host: (replicate, shard)
        names = ("replicate", "shard")
        mesh = init_device_mesh("cpu", (hosts, per_host), mesh_dim_names=names)
    for block in getattr(model, "blocks"):  # noqa: B009
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, _adamw(model.parameters())


def _host_bytes(fn: Callable[[], None], steps: int, first: bool) -> float:
    """Bytes this host sent over its link per step of ``fn`` (on its first rank; else 0)."""
    phalanx.barrier()
    before = link_tx_bytes() if first else 0
    for _ in range(steps):
        fn()
    phalanx.barrier()
    return (link_tx_bytes() - before) / steps if first else 0.0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="zero_hybrid_worker", description=__doc__)
    p.add_argument("out", type=Path)
    p.add_argument("--impls", default=",".join(DEFAULT), help=f"comma list of {IMPLS}")
    p.add_argument("--iters", type=int, default=10, help="timed steps per implementation")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--byte-steps", type=int, default=3, help="steps the link bytes average over")
    p.add_argument("--batch", type=int, default=16, help="windows per rank per step")
    p.add_argument("--world-backend", default="auto", help="the default group's backend")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    torch.set_num_threads(1)
    world = phalanx.init_process_group(None if args.world_backend == "auto" else args.world_backend)
    from phalanx.sharding.hybrid import make_hybrid_groups

    hybrid = make_hybrid_groups(world)
    hosts, per_host = hybrid.plan.hosts, hybrid.plan.per_host
    impls = [i for i in args.impls.split(",") if i]
    runs = {
        i: _torch(i, hosts, per_host) if i.startswith("torch") else _phalanx(i, hybrid)
        for i in impls
    }
    x, y = char_batch(world.rank, args.batch)
    first = world.local_rank == 0
    out: dict[str, Any] = {}
    for impl, (model, opt) in runs.items():  # bytes and state first, one at a time
        step = partial(train_step, model, opt, x, y)
        for _ in range(args.warmup):
            step()
        phalanx.reset_comm_stats()
        step()
        sent = sum(b for _, b in phalanx.comm_stats().values())
        out[impl] = {
            "times": [],
            "comm_bytes": None if impl.startswith("torch") else sent,
            "host_tx_bytes": _host_bytes(step, args.byte_steps, first),
            "state": state_bytes(model, opt),
        }
    for it in range(args.iters):
        shift = it % len(impls)
        for impl in impls[shift:] + impls[:shift]:
            model, opt = runs[impl]
            out[impl]["times"].append(timed(partial(train_step, model, opt, x, y)))
    report = {
        "rank": world.rank,
        "node": world.node_rank,
        "local_rank": world.local_rank,
        "layout": hybrid.describe(),
        "world_backend": world.backend,
        "impls": out,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{world.rank}.json").write_text(json.dumps(report))
    dist.barrier()
    phalanx.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
