"""``phalanx bench zero_hybrid``: hybrid sharding against ZeRO-3 over every rank, DDP and torch's
HSDP, across two machines joined by a slow link.

Two namespace hosts whose links are capped at ``--mbit`` each way (``bench.hosts``: ``tc tbf``)
stand for two machines; each runs ``phalanx run`` with ``--nproc-per-node`` workers (default 2:
a job of 2 hosts x 2 ranks), which train ``phalanx bench zero``'s char GPT with every
implementation interleaved, step by step (``zero_hybrid_worker``):

- ``hybrid3``: phalanx ZeRO-3 sharded inside each host (shm) and replicated across hosts (gloo),
  what ``phalanx.Zero(stage=3, shard="host")`` runs;
- ``zero3``: phalanx ZeRO-3 over all ranks; ``ddp``: phalanx DDP over all ranks;
- ``torch-hsdp``: torch's hybrid sharding, FSDP2 ``fully_shard`` on a 2-D (replicate, shard)
  ``DeviceMesh``: the torch-native baseline of ``hybrid3``;
- on request: ``torch-fsdp`` (``fully_shard`` over all ranks), ``hybrid2`` (phalanx ZeRO-2 with
  the hybrid groups).

Reported per implementation: p50 / p90 step time (the slowest rank's), the ratio to
``torch-hsdp`` and to ``zero3``, the bytes each host sent over its link per step (its
interface counter; the link carries only traffic between hosts), the bytes each rank handed to
collectives (phalanx only) and the model-state bytes per rank. Needs root and iproute2 (network
namespaces); without them it says so and exits 2. ``--world-backend`` sets the default group's
backend, which all but ``hybrid3`` / ``hybrid2`` run on (``gloo``, or ``shm``: hierarchical
across hosts). The last line is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from phalanx.bench.common import Output, add_common_flags
from phalanx.bench.hosts import Hosts, launch_on_hosts, namespace_hosts, unavailable
from phalanx.bench.zero_hybrid_worker import DEFAULT, IMPLS

__all__ = ["main", "summarize"]

BASELINES = ("torch-hsdp", "zero3")


def _run(link: Hosts, nproc: int, out: Path, worker_args: list[str], timeout: float) -> None:
    """One ``phalanx run`` agent per host, ``nproc`` workers each; raise naming a failure."""
    worker = ["-m", "phalanx.bench.zero_hybrid_worker", str(out), *worker_args]
    launch_on_hosts(link, [nproc, nproc], worker, timeout)


def summarize(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per implementation from every rank's report."""
    first = reports[0]["impls"]
    hosts = [r for r in reports if r["local_rank"] == 0]
    rows = []
    for impl, r in first.items():
        p50 = statistics.median(r["times"])
        ordered = sorted(r["times"])
        row: dict[str, Any] = {
            "impl": impl,
            "p50_ms": 1e3 * p50,
            "p90_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
            "host_tx_bytes_per_step": statistics.mean(
                h["impls"][impl]["host_tx_bytes"] for h in hosts
            ),
            "comm_bytes_per_step": r["comm_bytes"],
            "model_state_bytes": sum(r["state"].values()),
        }
        for base in BASELINES:
            if base in first:
                row[f"vs_{base}"] = p50 / statistics.median(first[base]["times"])
        rows.append(row)
    return rows


def _print(rows: list[dict[str, Any]], mbit: float, layout: str) -> None:
    print(f"\n{layout}; link {mbit:g} Mbit/s each way (tc tbf between two network namespaces)")
    head = ("impl", "p50 ms", "p90 ms", "x hsdp", "x zero3", "link MB", "comm MB", "state MB")
    print("".join(f"{h:<12}" if i == 0 else f"{h:>9}" for i, h in enumerate(head)))
    for r in rows:
        ratios = [r.get(f"vs_{b}") for b in BASELINES]
        comm = r["comm_bytes_per_step"]
        print(
            f"{r['impl']:<12}{r['p50_ms']:>9.1f}{r['p90_ms']:>9.1f}"
            + "".join("        -" if x is None else f"{x:>9.2f}" for x in ratios)
            + f"{r['host_tx_bytes_per_step'] / 1e6:>9.2f}"
            + ("        -" if comm is None else f"{comm / 1e6:>9.2f}")
            + f"{r['model_state_bytes'] / 1e6:>9.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    """``phalanx bench zero_hybrid [--mbit 100] [--iters 10] [--impls ...] [--out DIR]``."""
    parser = argparse.ArgumentParser(prog="phalanx bench zero_hybrid", description=__doc__)
    parser.add_argument("--mbit", type=float, default=100.0, help="link rate each way, Mbit/s")
    parser.add_argument("--nproc-per-node", type=int, default=2, help="ranks on each host")
    parser.add_argument("--iters", type=int, default=10, help="timed steps per implementation")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--batch", type=int, default=16, help="windows per rank per step")
    parser.add_argument("--impls", default=",".join(DEFAULT), help=f"comma list of {IMPLS}")
    parser.add_argument(
        "--world-backend",
        default="auto",
        choices=("auto", "gloo", "shm"),
        help="the default group's backend (zero3, ddp, torch-*): auto is phalanx run's choice",
    )
    add_common_flags(parser, "zero_hybrid", quick="a few iterations")
    args = parser.parse_args(argv)
    impls = [i for i in args.impls.split(",") if i]
    if not impls or any(i not in IMPLS for i in impls):
        parser.error(f"--impls must name some of {', '.join(IMPLS)}, got {args.impls!r}")
    for flag in ("mbit", "nproc_per_node", "iters", "batch"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if args.quick:
        args.iters, args.warmup = 3, 1
    if (why := unavailable()) is not None:
        print(f"phalanx bench zero_hybrid: {why}", file=sys.stderr)
        return 2
    output = Output.create("zero_hybrid", args.out, args.json)
    worker_args = ["--impls", ",".join(impls), "--iters", str(args.iters)]
    worker_args += ["--warmup", str(args.warmup), "--batch", str(args.batch)]
    worker_args += ["--world-backend", args.world_backend]
    with tempfile.TemporaryDirectory(prefix="phalanx-zero-hybrid-") as tmp:
        reports_dir = Path(tmp) / "reports"
        with namespace_hosts(2, args.mbit, shared=[tmp]) as link:
            _run(link, args.nproc_per_node, reports_dir, worker_args, timeout=3600)
        reports = [json.loads(p.read_text()) for p in sorted(reports_dir.glob("rank*.json"))]
    rows = summarize(reports)
    output.rows(rows)
    layout = reports[0]["layout"]
    _print(rows, args.mbit, layout)
    config = {
        "impls": impls,
        "iters": args.iters,
        "warmup": args.warmup,
        "batch": args.batch,
        "mbit": args.mbit,
        "layout": layout,
        "world_backend": reports[0]["world_backend"],
        "model": "char_gpt",
    }
    output.result({"config": config, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
