"""What Horovod's semantics cost per operation: ``hvd.allreduce`` vs the bare all-reduce.

Run under the launcher (two CPU ranks)::

    phalanx run --standalone --nproc-per-node 2 benchmarks/horovod_negotiation.py [--iters 400]

Every ``phalanx.horovod`` operation first takes part in one negotiation round (a 288-byte
all-gather per rank on the set's gloo group, ``controller.py``): that round is what buys the
RuntimeError on every rank for mismatched calls, name matching, and ``join()``. This script
times, interleaved in blocks (ABAB...), the round alone, ``hvd.allreduce`` (round + all-reduce)
and the same all-reduce through ``phalanx.all_reduce`` without a round, for a few sizes, and
reports medians per operation and the overhead (hvd minus bare); then a training step (MLP,
batch 32) with ``hvd.DistributedOptimizer`` against ``phalanx.DistributedDataParallel`` with
``find_unused_parameters=True``: the same bucket engine and settings without the per-pass
round. Both ranks run the same fixed counts. Prints a table and ends with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

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


def _steps(blocks: int) -> dict[str, float]:
    """Median step (ms) of hvd.DistributedOptimizer vs phalanx DDP on one MLP, interleaved."""

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                             nn.Linear(512, 10))  # fmt: skip

    # find_unused_parameters=True on both: DistributedOptimizer's default (Horovod's tolerance)
    hvd_model, ddp = mlp(), phalanx.DistributedDataParallel(mlp(), find_unused_parameters=True)
    hvd_opt = hvd.DistributedOptimizer(torch.optim.SGD(hvd_model.parameters(), lr=0.01),
                                       named_parameters=hvd_model.named_parameters())  # fmt: skip
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = torch.randn(32, 256), torch.randint(0, 10, (32,))

    def step(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None]:
        def run() -> None:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        return run

    variants = {"hvd": step(hvd_model, hvd_opt), "ddp": step(ddp, ddp_opt)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():
        _per_op_us(fn, 3)
    for _ in range(blocks):
        for name, fn in variants.items():
            times[name].append(_per_op_us(fn, 5) / 1e3)
    return {k: round(statistics.median(v), 2) for k, v in times.items()}


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
    payload["step_ms"] = _steps(blocks)
    if hvd.rank() == 0:
        print(f"negotiation round alone: {payload['round_us']:.0f} us per operation (median)")
        print(f"{'size':>8} {'bare us':>10} {'hvd us':>10} {'overhead us':>12}")
        for label, bare, neg, extra in rows:
            print(f"{label:>8} {bare:>10.0f} {neg:>10.0f} {extra:>12.0f}")
        steps = payload["step_ms"]
        print(f"MLP step: hvd.DistributedOptimizer {steps['hvd']:.2f} ms, phalanx DDP "
              f"{steps['ddp']:.2f} ms (same bucket engine, no per-pass round)")  # fmt: skip
        emit(payload, args.json)
    hvd.shutdown()


if __name__ == "__main__":
    main()
