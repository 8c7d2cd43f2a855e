"""Seed 001's point-to-point exchange: rank 0 adds 1 and sends; rank 1 adds 1 and sends it back.

    phalanx run --standalone --nproc-per-node 2 examples/p2p_pingpong.py

Blocking send/recv first, then the same round trip with isend/irecv.
"""

from __future__ import annotations

import torch

import phalanx


def blocking(rank: int) -> float:
    tensor = torch.zeros(1)
    if rank == 0:
        tensor += 1
        phalanx.send(tensor, dst=1)
        print(f"after send, rank {rank} has data {tensor[0]:.0f}")
        phalanx.recv(tensor, src=1)
        print(f"after recv, rank {rank} has data {tensor[0]:.0f}")
    else:
        phalanx.recv(tensor, src=0)
        print(f"after recv, rank {rank} has data {tensor[0]:.0f}")
        tensor += 1
        phalanx.send(tensor, dst=0)
        print(f"after send, rank {rank} has data {tensor[0]:.0f}")
    return float(tensor[0])


def nonblocking(rank: int) -> float:
    tensor = torch.full((1,), 10.0)
    if rank == 0:
        tensor += 1
        phalanx.isend(tensor, dst=1).wait()
        phalanx.irecv(tensor, src=1).wait()
    else:
        phalanx.irecv(tensor, src=0).wait()
        tensor += 1
        phalanx.isend(tensor, dst=0).wait()
    print(f"isend/irecv round trip: rank {rank} has data {tensor[0]:.0f}")
    return float(tensor[0])


def main() -> None:
    world = phalanx.init_process_group()
    try:
        if world.world_size != 2:
            raise SystemExit(f"p2p_pingpong needs exactly 2 processes, got {world.world_size}")
        assert blocking(world.rank) == 2.0
        assert nonblocking(world.rank) == 12.0
    finally:
        phalanx.destroy_process_group()


if __name__ == "__main__":
    main()
