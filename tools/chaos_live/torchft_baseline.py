#!/usr/bin/env python3
"""torchft baseline for issue 19's chaos harness: SIGKILL a replica of torchft's DDP example.

    bash tools/chaos_live/make_torchft_venv.sh            # once: /work/tftvenv with torchft 0.2.0
    python tools/chaos_live/torchft_baseline.py --replicas 2 --replicas 4 --runs 20

Not part of ``make test`` and not a dependency of phalanx: torchft lives only in a scratch venv
(``make_torchft_venv.sh``: ``--no-deps`` installs beside the CPU torch of ``.venv``). This driver
needs only torch; the replicas (``torchft_ddp_worker.py``, which follows torchft's
``train_ddp.py``) and the lighthouse (the wheel's ``torchft_lighthouse``) run from that venv.

Each run starts a lighthouse on 127.0.0.1 with the settings of torchft's README
(``--min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000``, heartbeat timeout 5000 ms
by default) and N replica groups of one gloo process each. Once every group has committed steps
at N participants, it waits a random delay, SIGKILLs a random replica (never the lighthouse)
and measures, from the wall-clock commit log of each survivor, kill -> the first step committed
in a new quorum: the slowest survivor counts, as in ``tools/recovery_latency`` (``fastest_*``:
the first survivor, as in ``tools/chaos_live/run.py``). It then starts a
new process for the same replica group (``--restart after-recovery``; ``immediate`` starts it
right after the kill, as a supervisor would), waits until it commits, sets a stop step and
checks correctness: every live replica ends at the stop step with bit-identical parameters.
Prints a table, the load average and ``RESULT {json}``.

Known: in torchft 0.2.0 a replica killed during the gradient all-reduce makes the survivors'
``backward()`` fail (``assert fut._fut`` in ``torchft/ddp.py``'s comm hook: the failed work never
built its future), so they die too and the run counts as incorrect. torchft-nightly 2026.10.26
hands DDP the bucket and skips the step instead: ``make_torchft_venv.sh VENV
torchft-nightly==2026.10.26`` and ``--venv VENV`` measure it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
WORKER = HERE / "torchft_ddp_worker.py"
README_LIGHTHOUSE = ["--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000"]


class RunFailed(Exception):
    """A phase of one run did not complete before its deadline."""


@dataclass
class Job:
    """The lighthouse and the replica processes of one run."""

    out: Path
    lighthouse: subprocess.Popen[bytes]
    address: str
    workers: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[int, Path] = field(default_factory=dict)
    dead: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def close(self) -> None:
        for proc in [*self.workers.values(), self.lighthouse]:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_job(args: argparse.Namespace, n: int, out: Path) -> Job:
    port = free_port()
    cmd = [str(args.venv / "bin" / "torchft_lighthouse"), *README_LIGHTHOUSE]
    cmd += ["--heartbeat_timeout_ms", str(args.heartbeat_timeout_ms), "--bind", f"127.0.0.1:{port}"]
    with (out / "lighthouse.log").open("wb") as log:
        lighthouse = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    job = Job(out, lighthouse, f"http://127.0.0.1:{port}")
    for group in range(n):
        start_worker(args, job, group, n)
    return job


def start_worker(args: argparse.Namespace, job: Job, group: int, n: int) -> float:
    """Start (or restart) replica group ``group``; its start time."""
    cmd = [str(args.venv / "bin" / "python"), str(WORKER), "--group", str(group)]
    cmd += ["--num-groups", str(n), "--lighthouse", job.address, "--out-dir", str(job.out)]
    cmd += ["--stop-file", str(job.out / "stop"), "--embedding-rows", str(args.embedding_rows)]
    t_start = time.time()
    job.logs[group] = job.out / f"worker{group}.{t_start:.3f}.log"
    with job.logs[group].open("wb") as log:
        job.workers[group] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    return t_start


def last_error(path: Path) -> str:
    """The last line of a replica's output that names an exception, if any."""
    lines = path.read_text(errors="replace").splitlines()
    errors = [line for line in lines if "Error" in line or "Exception" in line]
    return errors[-1].strip() if errors else ""


def records(job: Job, group: int) -> list[dict[str, float]]:
    """The JSON lines written by the current process of ``group`` (none before it starts)."""
    path = job.out / f"group{group}.{job.workers[group].pid}.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def commits(job: Job, group: int) -> list[dict[str, float]]:
    return [r for r in records(job, group) if "event" not in r]


def wait_for(what: str, job: Job, ready: Callable[[], bool], deadline: float) -> None:
    """Poll ``ready`` until it holds; a replica that exits unkilled (or with an error) fails."""
    while not ready():
        for group, proc in job.workers.items():
            code = proc.poll()
            if code is not None and proc not in job.dead and (code != 0 or what != "finish"):
                cause = last_error(job.logs[group])
                raise RunFailed(f"{what}: replica {group} exited with {code}: {cause}")
        if time.monotonic() > deadline:
            raise RunFailed(f"{what}: timed out")
        time.sleep(0.05)


def steady(job: Job, n: int, min_commits: int) -> bool:
    """Every group has committed ``min_commits`` steps at ``n`` participants."""
    full = [sum(c["participants"] == n for c in commits(job, g)) for g in range(n)]
    return min(full) >= min_commits


def after_kill(job: Job, group: int, t_kill: float) -> dict[str, float] | None:
    """``group``'s first commit after ``t_kill`` in a quorum other than the one it was in."""
    history = commits(job, group)
    before = [c["quorum"] for c in history if c["t"] <= t_kill]
    old = before[-1] if before else None
    return next((c for c in history if c["t"] > t_kill and c["quorum"] != old), None)


def first_commit_after(job: Job, group: int, t_kill: float) -> float | None:
    return next((c["t"] for c in commits(job, group) if c["t"] > t_kill), None)


def kill(job: Job, victim: int) -> float:
    proc = job.workers[victim]
    t_kill = time.time()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    job.dead.append(proc)
    return t_kill


def finish(job: Job, n: int, tail_steps: int, deadline: float) -> tuple[int, str]:
    """Set the stop step, wait for every replica to exit; (stop step, problem or '')."""
    stop = max(c["step"] for g in range(n) for c in commits(job, g)) + tail_steps
    (job.out / "stop").write_text(str(stop))
    live = list(job.workers.values())
    wait_for("finish", job, lambda: all(p.poll() is not None for p in live), deadline)
    return int(stop), check_final(job, n, int(stop))


def check_final(job: Job, n: int, stop: int) -> str:
    """'' if every replica ended at ``stop`` with bit-identical parameters, else what differs."""
    ends = {g: [r for r in records(job, g) if r.get("event") == "done"] for g in range(n)}
    last = {g: e[-1]["step"] if e else None for g, e in ends.items()}
    wrong = {g: step for g, step in last.items() if step != stop}
    if wrong:
        return f"final steps {wrong} != stop {stop}"
    states = [
        torch.load(job.out / f"final.{g}.{job.workers[g].pid}.pt", weights_only=True)
        for g in range(n)
    ]
    for g, state in enumerate(states[1:], start=1):
        unequal = [k for k in state if not torch.equal(state[k], states[0][k])]
        if unequal:
            return f"replica {g}'s {unequal} differ from replica 0's"
    return ""


def one_run(args: argparse.Namespace, n: int, rng: random.Random, out: Path) -> dict[str, object]:
    out.mkdir(parents=True)
    deadline = time.monotonic() + args.run_timeout
    row: dict[str, object] = {"replicas": n, "load": os.getloadavg()[0]}
    job = start_job(args, n, out)
    try:
        wait_for("steady", job, lambda: steady(job, n, args.warm_steps), deadline)
        time.sleep(rng.uniform(0.0, args.max_delay))
        victim = rng.randrange(n)
        survivors = [g for g in range(n) if g != victim]
        row.update(victim=victim, t_kill=kill(job, victim))
        t_kill = float(row["t_kill"])  # type: ignore[arg-type]
        if args.restart == "immediate":
            row["t_restart"] = start_worker(args, job, victim, n)
        ready = lambda: all(after_kill(job, g, t_kill) for g in survivors)  # noqa: E731
        wait_for("recovery", job, ready, deadline)
        recovered = [after_kill(job, g, t_kill) for g in survivors]
        row["latency_s"] = max(c["t"] for c in recovered if c) - t_kill
        row["fastest_s"] = min(c["t"] for c in recovered if c) - t_kill  # as chaos_live/run.py
        row["participants"] = min(c["participants"] for c in recovered if c)
        firsts = [first_commit_after(job, g, t_kill) for g in survivors]
        row["first_commit_s"] = min(t for t in firsts if t) - t_kill
        if args.restart == "after-recovery":
            row["t_restart"] = start_worker(args, job, victim, n)
        wait_for("rejoin", job, lambda: bool(commits(job, victim)), deadline)
        row["rejoin_s"] = commits(job, victim)[0]["t"] - float(row["t_restart"])  # type: ignore[arg-type]
        row["stop"], row["problem"] = finish(job, n, args.tail_steps, deadline)
    except RunFailed as exc:
        row["problem"] = str(exc)
    finally:
        job.close()
        for pt in out.glob("final.*.pt"):
            pt.unlink()
    row["correct"] = row["problem"] == ""
    (out / "row.json").write_text(json.dumps(row))
    return row


def versions(venv: Path) -> dict[str, str]:
    code = (
        "import importlib.metadata as m, torch; d = m.packages_distributions()['torchft'][0]; "
        "print(d, m.version(d), torch.__version__)"
    )
    cmd = [str(venv / "bin" / "python"), "-c", code]
    text = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if text.returncode != 0:
        raise SystemExit(f"--venv {venv}: cannot import torchft and torch:\n{text.stderr}")
    dist, torchft, torch_version = text.stdout.split()
    return {"torchft": f"{dist} {torchft}", "torch": torch_version}


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def summary(n: int, rows: list[dict[str, object]]) -> dict[str, object]:
    latencies = [float(r["latency_s"]) for r in rows if "latency_s" in r]  # type: ignore[arg-type]
    fastest = [float(r["fastest_s"]) for r in rows if "fastest_s" in r]  # type: ignore[arg-type]
    return {
        "replicas": n,
        "runs": len(rows),
        "correct": sum(bool(r["correct"]) for r in rows),
        "measured": len(latencies),
        "median_s": statistics.median(latencies) if latencies else None,
        "p90_s": p90(latencies) if latencies else None,
        "fastest_survivor_median_s": statistics.median(fastest) if fastest else None,
        "fastest_survivor_p90_s": p90(fastest) if fastest else None,
        "load_mean": statistics.mean(float(r["load"]) for r in rows),  # type: ignore[arg-type]
        "problems": sorted({str(r["problem"]) for r in rows if r["problem"]}),
    }


def print_row(i: int, row: dict[str, object]) -> None:
    def fmt(key: str) -> str:
        value = row.get(key)
        if isinstance(value, float):
            return f"{value:.3f}"
        return "-" if value is None else str(value)

    cols = ["replicas", "victim", "latency_s", "first_commit_s", "rejoin_s", "stop", "load"]
    cells = " ".join(f"{fmt(c):>14}" for c in cols)
    print(f"{i:4d} {cells}  {row['problem'] or 'ok'}", flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, action="append", help="2..4; may repeat")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--venv", type=Path, default=Path("/work/tftvenv"))
    restarts = ["after-recovery", "immediate"]
    parser.add_argument("--restart", choices=restarts, default="after-recovery")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=5000, help="its default")
    parser.add_argument("--embedding-rows", type=int, default=250_000)
    parser.add_argument("--warm-steps", type=int, default=5)
    parser.add_argument("--max-delay", type=float, default=1.0, help="before a kill, s")
    parser.add_argument("--tail-steps", type=int, default=10)
    parser.add_argument("--run-timeout", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/torchft_baseline"))
    args = parser.parse_args()
    args.replicas = args.replicas or [2]
    bad = [n for n in args.replicas if not 2 <= n <= 4]
    if bad:
        parser.error(f"--replicas must be 2..4, got {bad}")
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    return args


def main() -> None:
    args = parse_args()
    info = versions(args.venv)
    rng = random.Random(args.seed)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results = []
    print(f"{info['torchft']}, torch {info['torch']}, restart {args.restart}", flush=True)
    header = ["replicas", "victim", "kill->commit", "first commit", "rejoin", "stop", "load"]
    print("run " + " ".join(f"{c:>14}" for c in header), flush=True)
    for n in args.replicas:
        rows = []
        for i in range(args.runs):
            rows.append(one_run(args, n, rng, args.out / stamp / f"n{n}" / f"run{i}"))
            print_row(i, rows[-1])
        results.append(summary(n, rows))
        print(json.dumps(results[-1]), flush=True)
    lighthouse = [*README_LIGHTHOUSE, "--heartbeat_timeout_ms", str(args.heartbeat_timeout_ms)]
    setup = {"restart": args.restart, "lighthouse": " ".join(lighthouse)}
    setup["embedding_rows"] = str(args.embedding_rows)
    print("RESULT " + json.dumps({**info, **setup, "by_replicas": results}))


if __name__ == "__main__":
    main()
