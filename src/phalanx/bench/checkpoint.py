"""``phalanx bench checkpoint``: phalanx checkpoints against torch DCP and a raw write, by case.

A *case* is a state size (``--mb``, float32 parameters of a stack of linear layers, the same on
every rank as under data parallelism) and a number of ranks (``--ranks``, gloo processes on this
machine, meeting at a TCPStore as under ``phalanx run``). In each case every implementation of
``checkpoint_ops`` saves and loads the state in interleaved rounds (``checkpoint_rounds``):
phalanx's ``save`` / ``load``, torch DCP's, a raw ``write`` + ``fsync`` / ``readinto`` (the
floor), and the asynchronous saves of phalanx (``async_=True``) and DCP (``async_save``, with
its writer on a thread and in a process), whose ``block_s`` is how long the caller was held
and ``step_slowdown`` how much slower the rank's training steps ran while it wrote. Loads are
timed with the page cache warm (the files just written) and, with ``--cold``, again after
every file was evicted (``posix_fadvise``).

Per case: median seconds, MB/s (state MB / median), and phalanx's throughput over DCP's and the
raw one's. The ``RESULT {json}`` line holds every case under ``cases``; its top-level keys are
those of the first case (``impls`` with ``phalanx``, ``dcp`` and ``raw`` each holding
``save_mbps`` and ``load_mbps``, ``save_ratio_vs_dcp``, ``load_ratio_vs_dcp``, ...,
``phalanx_async``, ``dcp_async`` and ``dcp_async_process`` with ``block_s``, ``total_s`` and
``step_slowdown``).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from phalanx.bench.checkpoint_ops import make_model
from phalanx.bench.checkpoint_rounds import Times, column, rank_job
from phalanx.bench.common import Output, add_common_flags

__all__ = ["main", "summarize"]


def _state_mb(mb: float) -> float:
    return sum(t.numel() * t.element_size() for t in make_model(mb).state_dict().values()) / 1e6


def summarize(times: Times, state_mb: float, ranks: int) -> dict[str, Any]:
    """One case's medians, MB/s, phalanx/dcp and phalanx/raw throughput ratios, async blocks."""
    out: dict[str, Any] = {"state_mb": state_mb, "ranks": ranks, "impls": {}}
    for impl, by_measure in times.items():
        if "block" in by_measure:
            out[impl] = {column(m): statistics.median(ts) for m, ts in by_measure.items()}
            continue
        row = {f"{m}_s": statistics.median(ts) for m, ts in by_measure.items()}
        row.update({f"{m}_mbps": state_mb / row[f"{m}_s"] for m in by_measure})
        out["impls"][impl] = row
    ours = out["impls"]["phalanx"]
    for other in ("dcp", "raw"):
        for op in ("save", "load", "load_cold"):
            if f"{op}_mbps" in ours:
                theirs = out["impls"][other][f"{op}_mbps"]
                out[f"{op}_ratio_vs_{other}"] = ours[f"{op}_mbps"] / theirs
    out["async_block_ratio_vs_dcp"] = out["phalanx_async"]["block_s"] / out["dcp_async"]["block_s"]
    return out


def _print(case: dict[str, Any], rounds: int) -> None:
    cold = "load_cold_s" in case["impls"]["phalanx"]
    print(
        f"checkpoint of {case['state_mb']:.1f} MB on {case['ranks']} rank(s), median of "
        f"{rounds} rounds (MB/s: state MB / seconds)"
    )
    header = f"{'impl':<15}{'save s':>8}{'MB/s':>7}{'load s':>8}{'MB/s':>7}"
    print(header + (f"{'cold s':>8}{'MB/s':>7}" if cold else ""))
    for impl, r in case["impls"].items():
        line = f"{impl:<15}{r['save_s']:>8.3f}{r['save_mbps']:>7.0f}"
        line += f"{r['load_s']:>8.3f}{r['load_mbps']:>7.0f}"
        print(line + (f"{r['load_cold_s']:>8.3f}{r['load_cold_mbps']:>7.0f}" if cold else ""))
    for impl in ("phalanx_async", "dcp_async", "dcp_async_process"):
        r = case[impl]
        print(
            f"{impl:<18}blocked {r['block_s'] * 1e3:.1f} ms, durable after {r['total_s']:.3f} s,"
            f" training steps {100 * r['step_slowdown']:+.1f}% while it wrote"
        )
    for other in ("dcp", "raw"):
        ratios = ", ".join(
            f"{op} {case[key]:.2f}x"
            for op in ("save", "load", "load_cold")
            if (key := f"{op}_ratio_vs_{other}") in case
        )
        print(f"phalanx / {other} throughput: {ratios}")
    print(f"phalanx / dcp async block: {case['async_block_ratio_vs_dcp']:.2f}x\n")


def _numbers(parser: argparse.ArgumentParser, flag: str, text: str, kind: type) -> list[Any]:
    try:
        values = [kind(v) for v in text.split(",") if v]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        parser.error(f"--{flag} must be a comma list of numbers > 0, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    """``phalanx bench checkpoint [--quick] [--mb 100,1000] [--ranks 1,2] [--rounds 3] ...``."""
    from phalanx.testing import run_distributed

    parser = argparse.ArgumentParser(prog="phalanx bench checkpoint", description=__doc__)
    parser.add_argument("--mb", default="100,1000", help="state sizes in MB (comma list)")
    parser.add_argument("--ranks", default="1,2", help="numbers of ranks (comma list)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (median)")
    parser.add_argument("--cold", action="store_true", help="also load with the cache evicted")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    add_common_flags(parser, "checkpoint", quick="as --mb 10 --ranks 1,2 --rounds 1")
    args = parser.parse_args(argv)
    if args.quick:
        args.mb, args.ranks, args.rounds = "10", "1,2", 1
    sizes = _numbers(parser, "mb", args.mb, float)
    world_sizes = _numbers(parser, "ranks", args.ranks, int)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    output = Output.create("checkpoint", args.out, args.json)
    cases = []
    for mb in sizes:
        for ranks in world_sizes:
            workdir = Path(tempfile.mkdtemp(prefix="phalanx-bench-ckpt-", dir=args.dir))
            label = f"{mb:g}MBx{ranks}"
            cfg = {"mb": mb, "rounds": args.rounds, "cold": args.cold, "case": label}
            cfg.update(workdir=str(workdir), output=output)
            try:
                times = run_distributed(
                    rank_job,
                    cfg,
                    world_size=ranks,
                    timeout=300 + 0.2 * mb * (args.rounds + 1),
                    collective_timeout=600,
                    tcp=True,  # a TCPStore, as under phalanx run (a FileStore polls)
                    children=True,  # DCP's writer process
                )[0]
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
            cases.append(summarize(times, _state_mb(mb), ranks))
            _print(cases[-1], args.rounds)
    config = {"mb": sizes, "ranks": world_sizes, "rounds": args.rounds, "cold": args.cold}
    output.result({**cases[0], "cases": cases, "config": config})
    return 0
