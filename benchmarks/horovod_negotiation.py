"""What Horovod's semantics cost per operation: ``hvd.allreduce`` vs the bare all-reduce.

Run under the launcher (two CPU ranks)::

    phalanx run --standalone --nproc-per-node 2 benchmarks/horovod_negotiation.py [--iters 400]

Every ``phalanx.horovod`` operation first takes part in one negotiation round (a 288-byte
all-gather per rank on the set's gloo group, ``controller.py``): that round is what buys the
RuntimeError on every rank for mismatched calls, name matching, and ``join()``. This script
times, interleaved in blocks (ABAB...), the round alone, ``hvd.allreduce`` (round + all-reduce)
and the same all-reduce through ``phalanx.all_reduce`` without a round, for a few sizes, and
reports medians per operation and the overhead (hvd minus bare). Both ranks run the same fixed
counts. Prints a table and ends with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import phalanx
import phalanx.horovod as hvd
from phalanx.bench.common import emit
from phalanx.horovod.process_sets import controller, global_process_set
from phalanx.horovod.protocol import Row, State

SIZES = {"4 B": 1, "4 KiB": 1024, "1 MiB": 256 * 1024}
BLOCK = 20


def _per_op_us(fn: Callable[[], object], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def _round() -> None:
    ctl = controller(global_process_set)
    ctl._exchange(Row(State.BLOCKING, 9, 1, 2, 0, (), 0, ()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=400, help="operations per variant and size")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    blocks = max(1, args.iters // BLOCK)
    rows, payload = [], {"world_size": hvd.size(), "iters": blocks * BLOCK, "sizes": {}}
    rounds: list[float] = []
    for label, numel in SIZES.items():
        x = torch.ones(numel)
        variants: dict[str, Callable[[], object]] = {
            "bare": lambda x=x: phalanx.all_reduce(x.clone()),
            "hvd": lambda x=x: hvd.allreduce(x, op=hvd.Sum),
        }
        times: dict[str, list[float]] = {k: [] for k in variants}
        for fn in variants.values():  # warm up
            _per_op_us(fn, 5)
        for _ in range(blocks):  # ABAB: both see the same noise
            for name, fn in variants.items():
                times[name].append(_per_op_us(fn, BLOCK))
            rounds.append(_per_op_us(_round, BLOCK))
        bare, neg = statistics.median(times["bare"]), statistics.median(times["hvd"])
        rows.append((label, bare, neg, neg - bare))
        payload["sizes"][label] = {"bare_us": round(bare, 1), "hvd_us": round(neg, 1),
                                   "overhead_us": round(neg - bare, 1)}  # fmt: skip
    payload["round_us"] = round(statistics.median(rounds), 1)
    if hvd.rank() == 0:
        print(f"negotiation round alone: {payload['round_us']:.0f} us per operation (median)")
        print(f"{'size':>8} {'bare us':>10} {'hvd us':>10} {'overhead us':>12}")
        for label, bare, neg, extra in rows:
            print(f"{label:>8} {bare:>10.0f} {neg:>10.0f} {extra:>12.0f}")
        emit(payload, args.json)
    hvd.shutdown()


if __name__ == "__main__":
    main()
