"""``phalanx bench hosts_backend``: the hierarchical shm group against gloo, across machines.

Two namespace hosts (``bench.hosts``: own network, host name, ``/dev/shm``; ``tc tbf`` caps
each host's link at ``--mbit`` each way) stand for two machines, each running ``phalanx run
--backend shm --nproc-per-node N``: the job's default group is the hierarchical one (shared
memory inside each machine, gloo between their first ranks). In the same job, phalanx DDP trains
two copies of one MLP (``--hidden``, about 1.05 M parameters by default) from the same weights
on the same batches, one on that group and one on a gloo group of the same ranks, step by step
interleaved (ABBA, ``hosts_backend_worker``). Each rate in ``--mbit`` gets its own pair of
hosts; the ``--repeats`` jobs alternate between the rates.

Reported per rate and backend: the step time (median of every timed step of every repeat, the
slowest rank's; p10 / p90 and each repeat's median as the spread), the bytes that crossed the
link per step (each host's ``eth0`` sent plus received, mean over hosts), the last step's loss;
and the ratio hierarchical / gloo of the median step times, per repeat and pooled. Both
backends must reach the same loss (they add the same gradients in another order). Needs root
and iproute2 (network namespaces): without them it says so and exits 2. The last line is
``RESULT {json}`` with ``rates`` and ``ratios``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from phalanx.bench.common import Output, add_common_flags, at_least_one
from phalanx.bench.hosts import Hosts, launch_on_hosts, namespace_hosts, unavailable
from phalanx.bench.hosts_backend_worker import BACKENDS

__all__ = ["main", "parse_rates", "summarize"]

LOSS_RTOL = 1e-4
"""How close the two backends' last losses must be (the same sums, added in another order)."""


def parse_rates(text: str) -> list[float]:
    """``"100,1000"`` -> ``[100.0, 1000.0]``; ValueError naming ``--mbit`` otherwise."""
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        rates = []
    if not rates or any(not rate > 0 for rate in rates):
        raise ValueError(f"--mbit must be a comma list of rates > 0 in Mbit/s, got {text!r}")
    return rates


def run_job(link: Hosts, nproc: int, out: Path, worker_args: list[str], timeout: float) -> str:
    """One job over ``link``: ``phalanx run --backend shm`` on each host; node 0's start-up line."""
    worker = ["-m", "phalanx.bench.hosts_backend_worker", str(out), *worker_args]
    nodes = [nproc] * len(link.addr)
    logs = launch_on_hosts(link, nodes, worker, timeout, ["--backend", "shm"], ["PHALANX_BACKEND"])
    return next((line for line in logs[0].splitlines() if "starting ranks" in line), "")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _backend_row(name: str, reports: list[dict[str, Any]]) -> dict[str, Any]:
    times = [t for r in reports for t in r["times_s"][name]]
    per_host = [sum(b) for r in reports for host in r["link_bytes"][name] for b in host]
    return {
        "p50_ms": 1e3 * statistics.median(times),
        "p10_ms": 1e3 * _pct(times, 0.1),
        "p90_ms": 1e3 * _pct(times, 0.9),
        "repeat_p50_ms": [1e3 * statistics.median(r["times_s"][name]) for r in reports],
        "link_mb_per_step": statistics.mean(per_host) / 1e6,
        "final_loss": [r["final_loss"][name] for r in reports],
    }


def summarize(reports: list[dict[str, Any]], mbit: float) -> dict[str, Any]:
    """One rate's row from its repeats' reports (``hosts_backend_worker``'s JSON)."""
    kinds = {r["default_group"] for r in reports}
    if kinds != {"HierarchicalProcessGroup"}:
        raise RuntimeError(
            f"the jobs' default group was {', '.join(sorted(kinds))}, not the hierarchical shm "
            "group: each host's ranks did not see one machine and the others another"
        )
    rows = {name: _backend_row(name, reports) for name in BACKENDS}
    shm, gloo = rows["shm"], rows["gloo"]
    same = all(
        abs(r["final_loss"]["shm"] - r["final_loss"]["gloo"])
        <= LOSS_RTOL * max(1.0, abs(r["final_loss"]["gloo"]))
        for r in reports
    )
    first = reports[0]
    return {
        "link_mbit": mbit,
        "world_size": first["world_size"],
        "nodes": first["nodes"],
        "params": first["params"],
        "default_group": first["default_group"],
        "repeats": len(reports),
        "steps_per_repeat": first["steps"],
        "backends": rows,
        "ratio": shm["p50_ms"] / gloo["p50_ms"],
        "repeat_ratios": [a / b for a, b in zip(shm["repeat_p50_ms"], gloo["repeat_p50_ms"])],
        "bytes_ratio": shm["link_mb_per_step"] / gloo["link_mb_per_step"],
        "same_loss": same,
        "max_param_diff": max(r["max_param_diff"] for r in reports),
    }


def _print(rows: dict[str, dict[str, Any]]) -> None:
    head = ("Mbit/s", "backend", "p50 ms", "p10 ms", "p90 ms", "MB/step", "loss", "shm/gloo")
    print("\n" + "".join(f"{h:>10}" for h in head))
    for row in rows.values():
        for name in BACKENDS:
            b = row["backends"][name]
            ratio = f"{row['ratio']:>10.3f}" if name == "shm" else ""
            print(
                f"{row['link_mbit']:>10g}{name:>10}{b['p50_ms']:>10.1f}{b['p10_ms']:>10.1f}"
                f"{b['p90_ms']:>10.1f}{b['link_mb_per_step']:>10.2f}{b['final_loss'][-1]:>10.4f}"
                f"{ratio}"
            )
        spread = ", ".join(f"{r:.3f}" for r in row["repeat_ratios"])
        print(f"{'':>10}repeats' ratios: {spread}; same loss: {row['same_loss']}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phalanx bench hosts_backend", description=__doc__)
    parser.add_argument("--mbit", default="100,1000", help="link rates each way, Mbit/s (list)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per host (2 hosts)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per backend per job")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per backend first")
    parser.add_argument("--repeats", type=int, default=2, help="jobs per rate (rates alternate)")
    parser.add_argument("--hidden", type=int, default=1024, help="the MLP's hidden width")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    add_common_flags(
        parser, "hosts_backend", quick="as --mbit 1000 --steps 5 --warmup 1 --repeats 1"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """``phalanx bench hosts_backend [--quick] [--mbit 100,1000] [--nproc 2] [--steps 30] ...``."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.mbit, args.steps, args.warmup, args.repeats = "1000", 5, 1, 1
    try:
        rates = parse_rates(args.mbit)
    except ValueError as exc:
        parser.error(str(exc))
    at_least_one(parser, args, "nproc", "steps", "repeats", "hidden", "batch")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if (why := unavailable()) is not None:
        print(f"phalanx bench hosts_backend: {why}", file=sys.stderr)
        return 2
    output = Output.create("hosts_backend", args.out, args.json)
    worker_args = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    worker_args += ["--hidden", str(args.hidden), "--batch", str(args.batch)]
    timeout = 300 + 10.0 * (args.steps + args.warmup) * args.nproc
    reports: dict[float, list[dict[str, Any]]] = {rate: [] for rate in rates}
    startup = ""
    with tempfile.TemporaryDirectory(prefix="phalanx-hosts-backend-") as tmp, ExitStack() as stack:
        links = {
            rate: stack.enter_context(namespace_hosts(2, rate, shared=[tmp])) for rate in rates
        }
        for repeat in range(args.repeats):
            for rate in rates:
                out = Path(tmp) / f"{rate:g}-{repeat}.json"
                startup = run_job(links[rate], args.nproc, out, worker_args, timeout)
                reports[rate].append(json.loads(out.read_text()))
                times = reports[rate][-1]["times_s"]
                ratio = statistics.median(times["shm"]) / statistics.median(times["gloo"])
                output.rows([{"link_mbit": rate, "repeat": repeat, "ratio": ratio}])
    rows = {f"{rate:g}": summarize(reports[rate], rate) for rate in rates}
    _print(rows)
    print(f"start-up line: {startup.strip()}")
    config = {k: getattr(args, k) for k in ("nproc", "steps", "warmup", "repeats", "hidden")}
    config.update(batch=args.batch, mbit=rates, hosts=2)
    ratios = {k: row["ratio"] for k, row in rows.items()}
    output.result({"config": config, "rates": rows, "ratios": ratios, "startup_line": startup})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
