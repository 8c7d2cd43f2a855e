"""What the always-on mismatch check costs: check on / off, interleaved, in one invocation.

    python tools/mismatch_check_cost.py [--quick]

Two gloo ranks (``phalanx.testing.run_distributed``). Cases:

- ``ddp-mlp/<cap>``: a phalanx DDP training step of the 4.2 M-parameter MLP of
  ``phalanx bench ddp`` (batch 64) with ``bucket_cap_mb`` 25 (2 all-reduces per step) and 1
  (17 per step);
- ``all_reduce-4KiB``: a bare 4 KiB all-reduce, the worst case per collective.

Short blocks of steps alternate on / off in pairs (ABBA..., ``tracking.set_mismatch_check``,
switched at the same point on both ranks); each step is timed on the slowest rank. The overhead
is the median over pairs of (on block median / off block median) - 1, with its interquartile
range: pairs adjacent in time cancel the drift of a shared machine's load. The same for the CPU
time of both ranks' processes (all threads) per block, which neighbours disturb less than wall
time. The progress thread's
background work (publishing its windows, comparing with a neighbour every 0.5 s) is measured on
its own CPU clock, per second of wall time, in each setting. In one process it also times the
wire's ``watch.enter`` + ``leave`` (the per-collective hot path, through the installed
``tracking``) both ways. Last line: ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

from phalanx.bench.common import timed


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def _ddp_step(cap: float) -> Any:
    import phalanx

    torch.manual_seed(0)
    ddp = phalanx.DistributedDataParallel(_mlp(), bucket_cap_mb=cap)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = torch.randn(64, 1024), torch.randint(0, 10, (64,))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()

    return step


def _all_reduce_step() -> Any:
    import phalanx

    t = torch.ones(1024)

    def step() -> None:
        phalanx.all_reduce(t)

    return step


def _thread_cpu() -> float:
    """CPU seconds of this rank's progress thread so far."""
    from phalanx.diagnostics import tracking

    thread = tracking._T.thread  # type: ignore[union-attr]
    assert thread is not None and thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def _job_cpu(seconds: float) -> float:
    """CPU seconds of every rank's process (all threads) together."""
    import phalanx

    total = torch.tensor([seconds], dtype=torch.float64)
    phalanx.all_reduce(total)
    return float(total)


def _case(step: Any, pairs: int, per_block: int) -> dict[str, list[float]]:
    """``pairs`` on/off pairs of blocks (ABBA order) of ``per_block`` timed steps each."""
    from phalanx.diagnostics import tracking

    times: dict[str, list[float]] = {"on": [], "off": [], "ratio": [], "cpu_ratio": []}
    cpu = {"on": [0.0, 0.0], "off": [0.0, 0.0]}
    for _ in range(per_block):  # warm-up
        step()
    for p in range(pairs):
        block, used = {}, {}
        for on in (True, False) if p % 2 == 0 else (False, True):
            key = "on" if on else "off"
            tracking.set_mismatch_check(on)
            cpu0, wall0, proc0 = _thread_cpu(), time.perf_counter(), time.process_time()
            steps = [timed(step) for _ in range(per_block)]
            used[key] = _job_cpu(time.process_time() - proc0)
            cpu[key][0] += _thread_cpu() - cpu0
            cpu[key][1] += time.perf_counter() - wall0
            times[key].extend(steps)
            block[key] = statistics.median(steps)
        times["ratio"].append(block["on"] / block["off"])
        times["cpu_ratio"].append(used["on"] / used["off"])
    tracking.set_mismatch_check(True)
    times["cpu_ms_per_s"] = [1e3 * cpu[k][0] / cpu[k][1] for k in ("off", "on")]
    return times


def _rank_job(quick: bool) -> dict[str, dict[str, list[float]]]:
    torch.set_num_threads(1)
    pairs = 8 if quick else 60
    out = {}
    for cap in (25.0, 1.0):
        out[f"ddp-mlp/{cap:g}"] = _case(_ddp_step(cap), pairs, 3)
    out["all_reduce-4KiB"] = _case(_all_reduce_step(), pairs, 50)
    return out


def _hot_path(n: int) -> dict[str, float]:
    """Microseconds per ``enter`` + ``leave`` of one all-reduce, check on and off."""
    import tempfile
    from pathlib import Path

    import phalanx
    from phalanx.comm import watch
    from phalanx.diagnostics import tracking
    from phalanx.diagnostics.mismatch_check import Checker
    from phalanx.diagnostics.rank_files import RankFiles

    with tempfile.TemporaryDirectory() as d:
        phalanx.init_process_group("gloo", f"file://{d}/store", rank=0, world_size=1)
        t = torch.ones(1024)
        tracker = tracking._T  # one rank has no peers: give it what a rank of two has
        assert tracker is not None
        tracker.check, tracker.files = Checker(0, True), RankFiles(Path(d), 0)
        out = {}
        for on in (False, True, False, True):
            tracking.set_mismatch_check(on)
            start = time.perf_counter()
            for _ in range(n):
                watch.leave(None, watch.enter("all_reduce", None, t, reduce_op="SUM"))
            out["on" if on else "off"] = 1e6 * (time.perf_counter() - start) / n
        tracker.files.close()
        phalanx.destroy_process_group()
    return out


def _summary(runs: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    out = {}
    for case, t in runs.items():
        ratios, cpu = sorted(t["ratio"]), sorted(t["cpu_ratio"])
        out[case] = {
            "cpu_overhead_pct": 100 * (statistics.median(cpu) - 1),
            "cpu_overhead_iqr_pct": [
                100 * (cpu[len(cpu) // 4] - 1),
                100 * (cpu[(3 * len(cpu)) // 4] - 1),
            ],
            "steps_each": len(t["on"]),
            "off_p50_ms": 1e3 * statistics.median(t["off"]),
            "on_p50_ms": 1e3 * statistics.median(t["on"]),
            "overhead_pct": 100 * (statistics.median(ratios) - 1),
            "overhead_iqr_pct": [
                100 * (ratios[len(ratios) // 4] - 1),
                100 * (ratios[(3 * len(ratios)) // 4] - 1),
            ],
            "thread_cpu_ms_per_s_off": t["cpu_ms_per_s"][0],
            "thread_cpu_ms_per_s_on": t["cpu_ms_per_s"][1],
        }
    return out


def main(argv: list[str]) -> int:
    """Run the cases; print the table and ``RESULT {json}``."""
    from phalanx.testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer blocks (a smoke run)")
    args = parser.parse_args(argv)
    runs = run_distributed(_rank_job, args.quick, world_size=2, timeout=1800)[0]
    summary = _summary(runs)
    hot = _hot_path(20_000 if args.quick else 200_000)
    sys.stdout.write(
        f"{'case':<18}{'steps':>7}{'off p50':>10}{'on p50':>10}{'wall on/off-1 (IQR)':>26}"
        f"{'CPU on/off-1 (IQR)':>26}{'thread ms/s off/on':>20}\n"
    )
    for case, s in summary.items():
        lo, hi = s["overhead_iqr_pct"]
        clo, chi = s["cpu_overhead_iqr_pct"]
        sys.stdout.write(
            f"{case:<18}{s['steps_each']:>7}{s['off_p50_ms']:>10.3f}{s['on_p50_ms']:>10.3f}"
            f"{s['overhead_pct']:>+11.2f}% ({lo:+.1f}..{hi:+.1f}%)"
            f"{s['cpu_overhead_pct']:>+11.2f}% ({clo:+.1f}..{chi:+.1f}%)"
            f"{s['thread_cpu_ms_per_s_off']:>12.2f}/{s['thread_cpu_ms_per_s_on']:.2f}\n"
        )
    sys.stdout.write(
        f"enter+leave per collective: {hot['off']:.2f} us off, {hot['on']:.2f} us on\n"
    )
    result = {"cases": summary, "enter_leave_us": hot, "torch": torch.__version__}
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
