"""What one asynchronous all-reduce costs in Python: torch's call against phalanx's, interleaved.

    python tools/collective_overhead.py [--calls 4000] [--rounds 5] [--numel 1000]

One process, world size 1 on gloo (the backend's own work is then nearly nothing), times
``all_reduce(t, async_op=True).wait()`` through torch, through phalanx, and through phalanx with
its completion callback left out (``work.get_future().then(...)``, which closes the operation's
flight record from gloo's thread). Each round runs the three in turn; the medians of the rounds
are printed, wall and CPU microseconds per call, and ``RESULT {json}`` ends the output. The
difference between phalanx and torch is what every asynchronous collective (a DDP bucket's, say)
pays for phalanx's checks and diagnostics.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from collections.abc import Callable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _time(call: Callable[[], object], calls: int) -> tuple[float, float]:
    for _ in range(200):
        call()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        call()
    return (time.perf_counter() - wall) / calls * 1e6, (time.process_time() - cpu) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=4000, help="calls per measurement")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the three, interleaved")
    parser.add_argument("--numel", type=int, default=1000, help="float32 elements reduced")
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    os.environ.update(RANK="0", WORLD_SIZE="1")

    import torch
    import torch.distributed as dist

    import phalanx
    from phalanx.comm import collectives, work

    phalanx.init_process_group("gloo")
    tensor = torch.ones(args.numel)

    def torch_call() -> object:
        return dist.all_reduce(tensor, async_op=True).wait()

    def phalanx_call() -> object:
        return collectives.all_reduce(tensor, dist.ReduceOp.SUM, None, async_op=True).wait()

    def without_callback() -> object:
        work.CollectiveEntry.closes_from_future = False
        try:
            return phalanx_call()
        finally:
            work.CollectiveEntry.closes_from_future = True

    kinds = {"torch": torch_call, "phalanx": phalanx_call, "phalanx_no_callback": without_callback}
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for name, call in kinds.items():
            samples[name].append(_time(call, args.calls))
    phalanx.destroy_process_group()
    result = {}
    for name, runs in samples.items():
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        result[name] = {"wall_us": round(wall, 1), "cpu_us": round(cpu, 1)}
        print(f"{name:20s} {wall:7.1f} us wall {cpu:7.1f} us CPU per call (median of rounds)")
    print("RESULT " + json.dumps({"config": vars(args), "per_call": result}))


if __name__ == "__main__":
    main()
