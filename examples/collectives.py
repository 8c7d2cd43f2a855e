"""Every collective of seed 001, printing each rank's result.

    phalanx run --standalone --nproc-per-node 2 examples/collectives.py   # any world size

Each rank starts from tensors built from its rank, so the results are easy to check by hand.
"""

from __future__ import annotations

import torch

import phalanx
from phalanx import ReduceOp


def show(world: phalanx.World, name: str, value: object) -> None:
    print(f"{name:<24} rank {world.rank}: {value}")


def run(world: phalanx.World) -> None:
    r, n = world.rank, world.world_size

    t = torch.tensor([float(r)])
    phalanx.broadcast(t, src=0)
    show(world, "broadcast from 0", t.tolist())

    out = torch.zeros(2)
    parts = [torch.tensor([10.0 * i, 10.0 * i + 1]) for i in range(n)] if r == 0 else None
    phalanx.scatter(out, parts, src=0)
    show(world, "scatter from 0", out.tolist())

    mine = torch.tensor([float(r)])
    bucket = [torch.zeros(1) for _ in range(n)] if r == 0 else None
    phalanx.gather(mine, bucket, dst=0)
    if r == 0:
        show(world, "gather to 0", [b.item() for b in bucket or []])

    for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX):
        t = torch.tensor([float(r + 1)])
        phalanx.reduce(t, dst=0, op=op)
        if r == 0:
            show(world, f"reduce {op.name} to 0", t.item())
    for op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        t = torch.tensor([r + 1], dtype=torch.int64)
        phalanx.all_reduce(t, op=op)
        show(world, f"all_reduce {op.name}", t.item())

    gathered = [torch.zeros(1) for _ in range(n)]
    phalanx.all_gather(gathered, torch.tensor([float(r)]))
    show(world, "all_gather", [g.item() for g in gathered])

    for algorithm in ("native", "ring", "tree"):
        t = torch.arange(5, dtype=torch.float32) + r
        phalanx.all_reduce(t, algorithm=algorithm)
        show(world, f"all_reduce SUM ({algorithm})", t.tolist())

    shard = torch.zeros(1)
    phalanx.reduce_scatter_tensor(shard, torch.arange(n, dtype=torch.float32))
    show(world, "reduce_scatter_tensor", shard.tolist())

    objs: list[object] = [None] * n
    phalanx.all_gather_object(objs, {"rank": r, "hello": "world"})
    show(world, "all_gather_object", objs)
    phalanx.barrier()


def main() -> None:
    world = phalanx.init_process_group()
    try:
        run(world)
    finally:
        phalanx.destroy_process_group()


if __name__ == "__main__":
    main()
