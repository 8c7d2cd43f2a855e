"""``phalanx run --bind-cores`` against unbound workers: a compute-bound 2-rank job, interleaved.

    python tools/bind_cores/bench.py [--rounds 5]

Runs ``job.py`` under ``phalanx run --standalone --nproc-per-node 2``, alternately with and
without ``--bind-cores``, ``--rounds`` times each; prints each run's median step time and ends
with ``RESULT {json}``: the median of each side and their ratio (bound / unbound).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

JOB = Path(__file__).resolve().parent / "job.py"


def run(bound: bool) -> float:
    cmd = [sys.executable, "-m", "phalanx", "run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["--bind-cores"] if bound else []
    done = subprocess.run([*cmd, str(JOB)], capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(done.stdout + done.stderr)
    return float(done.stdout.split("STEP_MS ", 1)[1].split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"bound": [], "unbound": []}
    for i in range(args.rounds):
        for side in ("unbound", "bound") if i % 2 else ("bound", "unbound"):
            times[side].append(run(side == "bound"))
            print(f"round {i} {side:8} {times[side][-1]:.2f} ms/step", flush=True)
    med = {side: statistics.median(v) for side, v in times.items()}
    result = {
        "step_ms": med,
        "ratio_bound_to_unbound": med["bound"] / med["unbound"],
        "runs": times,
        "cores": len(os.sched_getaffinity(0)),
        "machine": platform.processor() or platform.machine(),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
