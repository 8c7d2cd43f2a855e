"""One rank of ``phalanx bench hosts_backend``: DDP over the hierarchical shm group and over gloo.

Started by the benchmark under ``phalanx run --backend shm`` on each namespace host
(``python -m phalanx.bench.hosts_backend_worker OUT_FILE [--steps ...]``), so the job's default
group is the hierarchical one (``comm/shm/hierarchical.py``: shared memory inside each machine,
gloo between their first ranks). A gloo group of the same ranks is made beside it. Two copies of
one MLP, from the same weights, train with phalanx DDP, one on each group, on the same batches:
step by step, the order alternating (ABBA), each step started after a barrier. Each machine's
first rank reads its ``eth0`` counters around every step (the interface carries only the
traffic between machines: the ranks of one machine talk over loopback or shared memory).

Rank 0 writes ``OUT_FILE`` (JSON): each step's time per backend (the slowest rank's), the bytes
each machine sent and received per step, the last step's mean loss per backend and the largest
difference between the two copies' parameters.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import phalanx

__all__ = ["BACKENDS", "link_bytes", "main", "mlp"]

BACKENDS = ("shm", "gloo")
"""The two groups compared: the job's default (hierarchical shm) and gloo."""
SEED = 1234
IN, OUT = 512, 10


def mlp(hidden: int) -> nn.Module:
    """512 -> hidden -> 512 -> 10 (about 1.05 M parameters at hidden 1024)."""
    return nn.Sequential(
        nn.Linear(IN, hidden), nn.ReLU(), nn.Linear(hidden, IN), nn.ReLU(), nn.Linear(IN, OUT)
    )


def link_bytes(dev: str = "eth0") -> tuple[int, int]:
    """``(tx, rx)`` bytes of this network namespace's ``dev`` so far."""
    stats = Path("/sys/class/net") / dev / "statistics"
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hosts_backend_worker", description=__doc__)
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=30, help="timed steps per backend")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per backend first")
    p.add_argument("--hidden", type=int, default=1024, help="the MLP's hidden width")
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.05)
    return p.parse_args(argv)


def _batch(rank: int, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of ``step``: the same for both backends."""
    g = torch.Generator().manual_seed(SEED + 100_003 * step + rank)
    return torch.randn(size, IN, generator=g), torch.randint(0, OUT, (size,), generator=g)


def _models(hidden: int, lr: float, groups: dict[str, Any]) -> dict[str, tuple[nn.Module, Any]]:
    """One DDP copy of the same MLP per group, each with its SGD."""
    torch.manual_seed(SEED)
    base = mlp(hidden)
    runs: dict[str, tuple[nn.Module, Any]] = {}
    for name, group in groups.items():
        model = mlp(hidden)
        model.load_state_dict(base.state_dict())
        ddp = phalanx.DistributedDataParallel(model, process_group=group)
        runs[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=lr))
    return runs


class Meter:
    """Times one step after a barrier on ``sync``; a machine's first rank reads its link."""

    def __init__(self, sync: Any, reads_link: bool) -> None:
        self.sync = sync
        self.reads_link = reads_link

    def __call__(self, step: Callable[[], float]) -> tuple[float, float, int, int]:
        """``(seconds, loss, tx, rx)`` of ``step`` (tx, rx: 0 on the other ranks)."""
        dist.barrier(group=self.sync)
        before = link_bytes() if self.reads_link else (0, 0)
        start = time.perf_counter()
        loss = step()
        took = time.perf_counter() - start
        dist.barrier(group=self.sync)  # every rank's traffic of this step is done
        after = link_bytes() if self.reads_link else (0, 0)
        return took, loss, after[0] - before[0], after[1] - before[1]


def _train(args: argparse.Namespace, runs: dict[str, tuple[nn.Module, Any]], meter: Meter) -> Any:
    """Interleaved steps; per backend: times [steps], bytes [steps, 2], the last losses."""
    rank = dist.get_rank()
    times = torch.zeros(len(BACKENDS), args.steps, dtype=torch.float64)
    link = torch.zeros(len(BACKENDS), args.steps, 2, dtype=torch.float64)
    losses = torch.zeros(len(BACKENDS), dtype=torch.float64)
    for i in range(args.warmup + args.steps):
        x, y = _batch(rank, i, args.batch)
        order = BACKENDS if i % 2 == 0 else BACKENDS[::-1]  # ABBA: neither always goes first
        for name in order:
            ddp, opt = runs[name]

            def step(ddp: nn.Module = ddp, opt: Any = opt, x: Any = x, y: Any = y) -> float:
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.cross_entropy(ddp(x), y)
                loss.backward()
                opt.step()
                return float(loss)

            took, loss, tx, rx = meter(step)
            b, t = BACKENDS.index(name), i - args.warmup
            losses[b] = loss
            if t >= 0:
                times[b, t] = took
                link[b, t] = torch.tensor([tx, rx], dtype=torch.float64)
    return times, link, losses


def _report(args: argparse.Namespace, runs: dict[str, Any], measured: Any, gloo: Any) -> Any:
    """On every rank: the job-wide figures (rank 0 writes them)."""
    times, link, losses = measured
    world, node = phalanx.world(), phalanx.world().node_rank
    nodes = world.world_size // world.local_world_size
    per_node = torch.zeros(len(BACKENDS), nodes, args.steps, 2, dtype=torch.float64)
    if world.local_rank == 0:
        per_node[:, node] = link
    dist.all_reduce(times, dist.ReduceOp.MAX, group=gloo)
    dist.all_reduce(per_node, group=gloo)
    dist.all_reduce(losses, group=gloo)
    pairs = zip(runs["shm"][0].parameters(), runs["gloo"][0].parameters())
    diff = torch.tensor([max(float((a - b).abs().max()) for a, b in pairs)], dtype=torch.float64)
    dist.all_reduce(diff, dist.ReduceOp.MAX, group=gloo)
    kind = type(dist.distributed_c10d._get_default_group()).__name__
    params = sum(p.numel() for p in runs["gloo"][0].parameters())
    return {
        "world_size": world.world_size,
        "nodes": nodes,
        "default_backend": world.backend,
        "default_group": kind,
        "params": params,
        "steps": args.steps,
        "warmup": args.warmup,
        "batch": args.batch,
        "times_s": {n: times[b].tolist() for b, n in enumerate(BACKENDS)},
        "link_bytes": {n: per_node[b].tolist() for b, n in enumerate(BACKENDS)},
        "final_loss": {n: float(losses[b]) / world.world_size for b, n in enumerate(BACKENDS)},
        "max_param_diff": float(diff),
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    torch.set_num_threads(1)
    world = phalanx.init_process_group()
    try:
        gloo = dist.new_group(backend="gloo")
        runs = _models(args.hidden, args.lr, {"shm": None, "gloo": gloo})
        meter = Meter(gloo, reads_link=world.local_rank == 0)
        report = _report(args, runs, _train(args, runs, meter), gloo)
        if world.rank == 0:
            args.out.write_text(json.dumps(report))
    finally:
        phalanx.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
