"""Chaos soak: SIGKILL a random rank at a random moment, many times; count correct finishes.

    python tools/chaos_soak.py --runs 20 --nproc 2            # kills at a random step
    python tools/chaos_soak.py --runs 20 --nproc 4 --mode time  # kills at a random time

Not part of ``make test`` (minutes). Each run starts ``phalanx run --max-restarts 1`` on
``tests/e2e/scripts/resume_job.py`` (a DDP job that checkpoints every epoch) and kills once:

- ``--mode step``: rank R (random, any rank) kills itself before a random step;
- ``--mode time``: this script SIGKILLs a random worker process at a random time after the
  workers start (up to 0.8x the fault-free run's duration), so kills land in start-up,
  training and checkpointing.

A run is correct when the launcher exits 0 and the final parameters' digest equals the
fault-free run's (bit-identical resume). Reported: correct runs, how many kills landed
(a kill after the job finished does not restart it), and the time from the kill to the first
training step after the restart. Last line: ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "resume_job.py"


def _cmd(nproc: int, ckpt: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "phalanx",
        "run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        "1",
        str(SCRIPT),
        str(ckpt),
        *extra,
    ]


def _steps(nproc: int) -> int:
    """Optimizer steps of resume_job.py: 4 epochs of 200 samples, batch 16, grad_accum 2."""
    batches = math.ceil(math.ceil(200 / nproc) / 16)
    return 4 * math.ceil(batches / 2)


def _field(out: str, key: str) -> str | None:
    line = next((ln for ln in out.splitlines() if key in ln), None)
    return None if line is None else line.split(key)[1].split()[0]


def _workers(launcher: int) -> list[int]:
    try:
        text = Path(f"/proc/{launcher}/task/{launcher}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _run_time_mode(nproc: int, ckpt: Path, at: float, rng: random.Random) -> tuple[str, float]:
    proc = subprocess.Popen(
        _cmd(nproc, ckpt), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 60
    while not _workers(proc.pid) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)  # count from the workers' start, not the launcher's imports
    time.sleep(at)
    killed_at = float("nan")
    workers = _workers(proc.pid)
    if workers and proc.poll() is None:
        os.kill(rng.choice(workers), signal.SIGKILL)
        killed_at = time.time()
    out, err = proc.communicate(timeout=300)
    return (out + "\n" + err if proc.returncode == 0 else f"rc={proc.returncode}\n{err}"), killed_at


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--mode", choices=("step", "time"), default="step")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="phalanx-chaos-"))
    start = time.time()
    clean = subprocess.run(_cmd(args.nproc, work / "clean"), capture_output=True, text=True)
    clean_s = time.time() - start
    reference = _field(clean.stdout, "DIGEST ")
    if clean.returncode != 0 or reference is None:
        print(clean.stderr, file=sys.stderr)
        return 2
    correct, landed, latencies = 0, 0, []
    for run in range(args.runs):
        ckpt = work / f"run-{run}"
        if args.mode == "step":
            step, rank = rng.randrange(1, _steps(args.nproc)), rng.randrange(args.nproc)
            stamp = work / f"stamp-{run}"
            proc = subprocess.run(
                _cmd(
                    args.nproc,
                    ckpt,
                    "--kill-step",
                    str(step),
                    "--kill-rank",
                    str(rank),
                    "--stamp",
                    str(stamp),
                ),
                capture_output=True,
                text=True,
                timeout=300,
            )
            out = proc.stdout + "\n" + proc.stderr if proc.returncode == 0 else proc.stderr
            killed_at = float(stamp.read_text()) if stamp.exists() else float("nan")
            what = f"rank {rank} before step {step}"
        else:
            at = rng.uniform(0.0, 0.8 * clean_s)
            out, killed_at = _run_time_mode(args.nproc, ckpt, at, rng)
            what = f"a random worker {at:.2f} s after the workers started"
        ok = _field(out, "DIGEST ") == reference
        restarted = "restarting all workers" in out
        first = _field(out, "FIRST_STEP ")
        latency = float(first) - killed_at if (restarted and first) else None
        correct += ok
        landed += restarted
        if latency is not None:
            latencies.append(latency)
        shown = "" if latency is None else f", first step {latency:.2f} s after the kill"
        if not ok:  # keep the evidence
            (work / f"run-{run}.log").write_text(out)
            shown += f"; output in {work / f'run-{run}.log'}: " + " | ".join(out.splitlines()[-3:])
        print(
            f"run {run}: killed {what}: {'OK' if ok else 'WRONG'}"
            f"{' (restarted)' if restarted else ' (no restart)'}{shown}",
            flush=True,
        )
    median = round(statistics.median(latencies), 3) if latencies else None
    result = {
        "runs": args.runs,
        "correct": correct,
        "kills_that_restarted": landed,
        "mode": args.mode,
        "nproc": args.nproc,
        "clean_run_s": round(clean_s, 2),
        "kill_to_first_step_s_median": median,
        "kill_to_first_step_s_max": round(max(latencies), 3) if latencies else None,
    }
    print(f"{correct} of {args.runs} runs finished with the fault-free parameters")
    print("RESULT " + json.dumps(result))
    return 0 if correct == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
