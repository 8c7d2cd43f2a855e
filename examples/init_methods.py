"""Seed 004's initialisation methods, started by hand, one terminal per process.

TCP (rank 0 hosts the store on the given address only):

    python examples/init_methods.py --init-method tcp://127.0.0.1:23456 --rank 0 --world-size 2
    python examples/init_methods.py --init-method tcp://127.0.0.1:23456 --rank 1 --world-size 2

Shared file (every process must see the same file system path; the file must not exist yet):

    python examples/init_methods.py --init-method file:///tmp/phalanx-init --rank 0 --world-size 2
    python examples/init_methods.py --init-method file:///tmp/phalanx-init --rank 1 --world-size 2

Environment (what `phalanx run` sets up for you):

    phalanx run --standalone --nproc-per-node 2 examples/init_methods.py --init-method env://
"""

from __future__ import annotations

import argparse

import torch

import phalanx


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init-method", default="env://", help="env://, tcp://H:P, file:///p")
    parser.add_argument("--rank", type=int, default=None, help="this process's rank")
    parser.add_argument("--world-size", type=int, default=None, help="number of processes")
    parser.add_argument("--backend", default="gloo", help="gloo, nccl, mpi or auto")
    parser.add_argument("--timeout", type=float, default=60.0, help="collective timeout, s")
    args = parser.parse_args(argv)
    with phalanx.process_group(
        args.backend,
        args.init_method,
        rank=args.rank,
        world_size=args.world_size,
        timeout=args.timeout,
    ) as world:
        t = torch.tensor([float(world.rank + 1)])
        phalanx.all_reduce(t)
        expected = world.world_size * (world.world_size + 1) / 2
        print(f"rank {world.rank}/{world.world_size} via {args.init_method}: sum={t.item():.0f}")
        if t.item() != expected:
            raise SystemExit(f"rank {world.rank}: expected {expected}, got {t.item()}")


if __name__ == "__main__":
    main()
