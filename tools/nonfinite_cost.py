"""The cost of ``Job(skip_nonfinite=True)``: a 2-rank DDP job's step time with and without it.

    python tools/nonfinite_cost.py [--rounds 5]        # runs itself under phalanx run

Each round runs the job twice (guard on, guard off, in alternating order) and prints the median
step time; ends with ``RESULT {json}``: each side's median and the ratio on / off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def job(guard: bool) -> None:
    import torch
    from torch import nn

    import phalanx

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512))
    data = [torch.randn(64, 512) for _ in range(4)]
    with phalanx.Job("ddp", skip_nonfinite=guard) as j:
        model, _opt = j.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        times = []
        for step in range(60):
            start = time.perf_counter()
            j.backward(model(data[step % 4]).square().mean())
            j.step()
            times.append(time.perf_counter() - start)
        if j.world.rank == 0:
            print(f"STEP_MS {1e3 * statistics.median(times[10:]):.3f}", flush=True)


def run(guard: bool) -> float:
    cmd = [sys.executable, "-m", "phalanx", "run", "--standalone", "--nproc-per-node", "2"]
    cmd += [__file__, "--job", "on" if guard else "off"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(done.stdout + done.stderr)
    return float(done.stdout.split("STEP_MS ", 1)[1].split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--job", choices=["on", "off"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        job(args.job == "on")
        return
    times: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(args.rounds):
        for side in ("on", "off") if i % 2 == 0 else ("off", "on"):
            times[side].append(run(side == "on"))
            print(f"round {i} guard {side:3} {times[side][-1]:.2f} ms/step", flush=True)
    med = {side: statistics.median(v) for side, v in times.items()}
    print(
        "RESULT "
        + json.dumps({"step_ms": med, "ratio_on_to_off": med["on"] / med["off"], "runs": times})
    )


if __name__ == "__main__":
    main()
