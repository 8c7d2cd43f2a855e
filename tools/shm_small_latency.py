"""Small all-reduces on ``backend="shm"``: this tree against a base revision, A/B interleaved.

    python tools/shm_small_latency.py [--base-rev REV] [--rounds 6] [--calls 2000]

The base revision's ``src/`` is extracted with ``git archive`` into a temporary directory. Each
round starts one 2-rank job (``phalanx.testing.run_distributed``) on one tree, alternating
ABBA...: base, this tree, this tree, base, ... Every rank issues ``--calls`` back-to-back
``dist.all_reduce`` calls per size (8 B, 1 KiB, 4 KiB of float32, after a warm-up), timing
each call's wall time and the calling thread's CPU time over the loop. Per round: rank 0's
wall p50 and both ranks' CPU microseconds per call; then, per tree and size, the median over
its rounds. CPU time is what a loaded machine inflates least; the 1-minute load average is
printed with each round. Last line: ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SIZES = (8, 1024, 4096)
ROOT = Path(__file__).resolve().parents[1]


def _rank(sizes: list[int], calls: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    out: dict[str, Any] = {}
    for size in sizes:
        t = torch.ones(max(1, size // 4))
        for _ in range(200):
            dist.all_reduce(t)
        dist.barrier()
        walls = []
        cpu0 = time.thread_time()
        for _ in range(calls):
            start = time.perf_counter()
            dist.all_reduce(t)
            walls.append(time.perf_counter() - start)
        cpu = (time.thread_time() - cpu0) / calls
        out[str(size)] = {"p50_us": statistics.median(walls) * 1e6, "cpu_us": cpu * 1e6}
    return out


def _child(sizes: list[int], calls: int) -> None:
    from phalanx.testing import run_distributed

    per_rank = run_distributed(_rank, sizes, calls, world_size=2, backend="shm", timeout=300)
    print(json.dumps(per_rank))


def _round(src: Path, sizes: list[int], calls: int) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    args = [sys.executable, __file__, "--child", "--calls", str(calls), "--sizes"]
    done = subprocess.run(
        args + [str(s) for s in sizes], env=env, capture_output=True, text=True, check=True
    )
    rows: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return rows


def _extract(rev: str, into: Path) -> Path:
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "src"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


def main() -> int:
    parser = argparse.ArgumentParser(prog="tools/shm_small_latency.py")
    parser.add_argument("--base-rev", default="HEAD", help="git revision to compare against")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per tree")
    parser.add_argument("--calls", type=int, default=2000, help="calls per size and round")
    parser.add_argument("--sizes", type=int, nargs="*", default=list(SIZES), help="bytes")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.child:
        _child(ns.sizes, ns.calls)
        return 0
    if ns.rounds < 1 or ns.calls < 1:
        raise SystemExit(f"--rounds and --calls must be >= 1, got {ns.rounds}, {ns.calls}")
    rows: dict[str, list[dict[str, Any]]] = {"base": [], "this": []}
    with tempfile.TemporaryDirectory(prefix="shm-ab-") as tmp:
        trees = {"base": _extract(ns.base_rev, Path(tmp)), "this": ROOT / "src"}
        order = [("base", "this"), ("this", "base")]
        for i in range(ns.rounds):
            for name in order[i % 2]:
                load = os.getloadavg()[0]
                ranks = _round(trees[name], ns.sizes, ns.calls)
                row = {"load": load, "ranks": ranks}
                rows[name].append(row)
                cells = [
                    f"{s} B p50 {ranks[0][str(s)]['p50_us']:.0f} us cpu "
                    + "/".join(f"{r[str(s)]['cpu_us']:.0f}" for r in ranks)
                    for s in ns.sizes
                ]
                print(f"round {i} {name:4s} load {load:.1f}: " + "; ".join(cells), flush=True)
    summary: dict[str, Any] = {"base_rev": ns.base_rev, "calls": ns.calls, "rounds": ns.rounds}
    for name, got in rows.items():
        for s in ns.sizes:
            p50 = statistics.median(r["ranks"][0][str(s)]["p50_us"] for r in got)
            cpu = statistics.median(x[str(s)]["cpu_us"] for r in got for x in r["ranks"])
            summary[f"{name}_{s}B_p50_us"] = round(p50, 1)
            summary[f"{name}_{s}B_cpu_us"] = round(cpu, 1)
            print(f"{name:4s} {s:>5} B: p50 {p50:.0f} us, CPU {cpu:.1f} us per call (median)")
    loads = [r["load"] for got in rows.values() for r in got]
    summary["load_min"], summary["load_max"] = round(min(loads), 2), round(max(loads), 2)
    print("RESULT " + json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
