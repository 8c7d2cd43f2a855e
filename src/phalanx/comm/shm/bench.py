"""``python -m phalanx.comm.shm.bench``: all_reduce over gloo and over shm, interleaved.

Two ranks (``--world-size``) on this machine; each makes the default group with
``backend="shm"`` and a gloo group over the same ranks, then for every size runs the two
alternately (gloo, shm, shm, gloo, ...), each after a barrier of its own backend. An
iteration's time is the slowest rank's. Prints p50 latency and bus bandwidth (nccl-tests:
``busbw = bytes / time * 2 (n - 1) / n``) per backend and size, the ratio shm / gloo, and a
single-process ``copy_`` of the same size for scale. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["main"]

SIZES = (4 << 10, 1 << 20, 4 << 20, 64 << 20)


def _timed(fn: object, barrier: object) -> float:
    barrier()  # type: ignore[operator]
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - t0


def _rank(sizes: Sequence[int], iters: int) -> dict[str, dict[int, list[float]]]:
    gloo = dist.new_group(backend="gloo")
    times: dict[str, dict[int, list[float]]] = {"gloo": {}, "shm": {}, "copy": {}}
    for size in sizes:
        n = max(1, iters if size < 16 << 20 else iters // 4)
        t = torch.ones(size // 4)
        scratch = torch.empty_like(t)
        groups = {"gloo": gloo, "shm": None}
        for name in ("gloo", "shm"):
            times[name][size] = []
        copy = functools.partial(scratch.copy_, t)
        times["copy"][size] = [_timed(copy, lambda: None) for _ in range(n)]
        for i in range(n + 2):
            order = ("gloo", "shm") if i % 2 else ("shm", "gloo")
            for name in order:
                g = groups[name]
                run = functools.partial(dist.all_reduce, t, group=g)
                took = _timed(run, functools.partial(dist.barrier, g))
                if i >= 2:  # warm-up
                    times[name][size].append(took)
    for name, group in (("gloo", gloo), ("shm", None)):
        times[f"wait {name}"] = {0: list(_waiting_cpu(group))}
        times[f"back-to-back {name}"] = {0: _back_to_back(group, iters * 5)}
    return times


def _back_to_back(group: object, n: int) -> list[float]:
    """Per-call times of ``n`` 4 KiB all-reduces issued one after the other (no barrier)."""
    t = torch.ones(1024)
    dist.barrier(group)  # type: ignore[arg-type]
    took = []
    for _ in range(n):
        start = time.perf_counter()
        dist.all_reduce(t, group=group)
        took.append(time.perf_counter() - start)
    return took


def _waiting_cpu(group: object, late_s: float = 1.0) -> tuple[float, float]:
    """(wall, CPU) seconds of rank 0's all_reduce while rank 1 arrives ``late_s`` late."""
    dist.barrier(group)  # type: ignore[arg-type]
    if dist.get_rank() == 1:
        time.sleep(late_s)
    wall, cpu = time.perf_counter(), time.process_time()
    dist.all_reduce(torch.ones(1024), group=group)
    return time.perf_counter() - wall, time.process_time() - cpu


def _summary(per_rank: list[dict[str, dict[int, list[float]]]], world: int) -> str:
    lines = [
        f"{'size':>8} {'gloo p50':>10} {'shm p50':>10} {'gloo busbw':>11} "
        f"{'shm busbw':>10} {'shm/gloo':>8} {'copy GB/s':>9}"
    ]
    factor = 2 * (world - 1) / world
    for size in per_rank[0]["shm"]:
        p50 = {}
        for name in ("gloo", "shm", "copy"):
            slowest = [max(ts) for ts in zip(*(r[name][size] for r in per_rank))]
            p50[name] = statistics.median(slowest)
        bw = {k: size / v / 1e9 for k, v in p50.items()}
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        lines.append(
            f"{label:>8} {p50['gloo'] * 1e6:>8.0f}us {p50['shm'] * 1e6:>8.0f}us "
            f"{bw['gloo'] * factor:>7.2f}GB/s {bw['shm'] * factor:>6.2f}GB/s "
            f"{p50['gloo'] / p50['shm']:>7.2f}x {bw['copy']:>9.2f}"
        )
    for name in ("gloo", "shm"):
        median = statistics.median(per_rank[0][f"back-to-back {name}"][0])
        lines.append(f"{name}: 4 KiB all_reduce back to back, rank 0's p50 {median * 1e6:.0f} us")
    for name in ("gloo", "shm"):
        wall, cpu = per_rank[0][f"wait {name}"][0]
        lines.append(
            f"{name}: rank 0 waited {wall:.2f} s for a late rank 1 and used {cpu * 1e3:.0f} ms "
            f"of CPU ({cpu / wall:.1%} of a core)"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from phalanx.testing import run_distributed

    parser = argparse.ArgumentParser(prog="python -m phalanx.comm.shm.bench")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--sizes", type=int, nargs="*", default=list(SIZES), help="bytes")
    args = parser.parse_args(argv)
    results = run_distributed(
        _rank, args.sizes, args.iters, world_size=args.world_size, backend="shm", timeout=600
    )
    print(_summary(results, args.world_size))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
