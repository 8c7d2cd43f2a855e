"""Straggler trials: is the slow rank named with its phase, quickly, and nobody on mere noise?

    python tools/straggler_trials.py [--trials 100] [--clean 20] [--ab-jobs 6] [--every 2]

Not part of ``make test`` (minutes on a 2-core machine). Three parts, each one 4-rank gloo job
(``phalanx.testing.run_distributed``) whose ranks build a fresh ``phalanx.Job`` per run:

1. **Trials.** Each trial draws (the same on every rank) a rank, a phase (data loading, forward,
   backward, optimizer step), a delay of 30-60 ms and an onset step in [10, 22]; from the onset
   on, that rank sleeps the delay in that phase of every step (a data loader that pauses, a
   forward pre-hook, a hook on the loss's gradient, a wrapped ``optimizer.step``). A trial
   succeeds when the job names nobody before the onset and its first finding names the right
   rank and phase at most 5 steps after it (the finding of step ``k`` is made at the end of
   step ``k``; onset ``s`` is the first slowed step; success needs ``k - s <= 5``).
2. **Clean runs** with a CPU hog (a busy-looping process) beside them: none may name anyone.
3. **Overhead**, A/B interleaved: in each of ``--ab-jobs`` jobs the straggler monitor runs in
   every other block of ``--block`` steps (the same steps on every rank); the overhead is the
   median over jobs of (median step time with it / without it) - 1. The time spent inside the
   monitor per step (wall and this thread's CPU) is reported too: the direct measure.

Every job trains a 3-layer MLP (256 -> ``--width`` -> ``--width`` -> 10, batch 64 per rank)
with phalanx DDP (or ``--strategies``, used in turn), ``straggler_check_every=--every`` and
the default ``StragglerRule``. The latency is 4 or 5 steps by construction with ``--every 2``:
the rule needs steps ``s`` to ``s + 3``, the gather holding step ``s + 3`` starts at the end of
``s + 3`` or ``s + 4``, and is collected one step later. ``--dump FILE`` keeps every run's
per-step reports, to replay a miss through the detector; ``--patience``, ``--quantile``,
``--z``, ``--min-ms``, ``--relative`` run the parts with another ``StragglerRule``.

Ends with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

PHASES = ("data", "forward", "backward", "optimizer")
WORLD = 4
STEPS = 30
ONSET = (10, 22)
DELAY_MS = (30.0, 60.0)
WITHIN = 5


@dataclass(frozen=True)
class Injection:
    """Rank ``rank`` sleeps ``delay`` s in ``phase`` of every step from step ``onset`` on."""

    rank: int = -1
    phase: str = "forward"
    delay: float = 0.0
    onset: int = 0
    strategy: str = "ddp"


class Injector:
    """Sleeps where and when the injection says, on its rank only."""

    def __init__(self, injection: Injection, me: int) -> None:
        self.injection, self.me, self.step = injection, me, 0

    def pause(self, phase: str) -> None:
        inj = self.injection
        if inj.rank == self.me and inj.phase == phase and self.step >= inj.onset:
            time.sleep(inj.delay)


class PausingLoader:
    """Batches of a DataLoader; the injector may pause before handing each out."""

    def __init__(self, loader: Any, injector: Injector) -> None:
        self.loader, self.injector = loader, injector

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Any:
        for batch in self.loader:
            self.injector.pause("data")
            yield batch


@dataclass(frozen=True)
class Setup:
    """What every job of a part runs: steps, gather period, model width, detector rule."""

    steps: int
    every: int
    width: int
    rule: dict[str, Any]
    """``StragglerRule`` fields that differ from the default."""


def _model(width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )


def _run(
    injection: Injection, setup: Setup, every: int, seed: int, toggle: int = 0
) -> dict[str, Any]:
    """One job on this rank: ``steps`` steps; what the detector named, when; step times.

    ``toggle > 0``: the monitor runs only in every other block of ``toggle`` steps (the same
    steps on every rank), so the steps with and without it interleave within the job.
    """
    import phalanx

    me = phalanx.world().rank
    injector = Injector(injection, me)
    torch.manual_seed(seed)
    model = _model(setup.width)
    steps = setup.steps
    model.register_forward_pre_hook(lambda _m, _a: injector.pause("forward"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    from phalanx.train import StragglerRule

    job = phalanx.Job(
        strategy=injection.strategy,
        straggler_check_every=every,
        straggler_rule=StragglerRule(**setup.rule),
        seed=seed,
    )
    if toggle:
        _timed_monitor(job)
    model, opt = job.setup(model, opt)
    assert opt is not None
    step = opt.step

    def paused_step(*args: Any, **kwargs: Any) -> Any:
        injector.pause("optimizer")
        return step(*args, **kwargs)

    opt.step = paused_step  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(seed)
    data = torch.utils.data.TensorDataset(
        torch.randn(steps * 64 * WORLD, 256, generator=g),
        torch.randint(0, 10, (steps * 64 * WORLD,), generator=g),
    )
    loader = PausingLoader(job.loader(data, batch_size=64, shuffle=True), injector)
    findings, seen, times, monitored = [], None, [], []
    monitor = job.timing.monitor
    reports = _record(monitor)
    last = time.perf_counter()
    for x, y in job.progress(loader):
        loss = F.cross_entropy(model(x), y)
        loss.register_hook(lambda grad: injector.pause("backward"))
        job.backward(loss)
        if toggle:  # the measurement's switch (a private attribute: the tool measures it)
            job.timing.monitor = monitor if (job.step_count // toggle) % 2 else None
        monitored.append(job.timing.monitor is not None)
        job.step()
        now = time.perf_counter()
        times.append(now - last)
        last = now
        injector.step = job.step_count
        found = job.straggler_finding
        if found is not None and found is not seen:
            findings.append(
                {
                    "step": job.step_count - 1,
                    "rank": found.rank,
                    "phase": found.phase,
                    "line": found.describe(),
                }
            )
            seen = found
    monitor_s = getattr(job, "_monitor_seconds", 0.0)
    monitor_cpu = getattr(job, "_monitor_cpu", 0.0)
    job.timing.monitor = monitor
    job.close()
    return {
        "findings": findings,
        "times": times,
        "monitor_s": monitor_s,
        "monitor_cpu": monitor_cpu,
        "monitored": monitored,
        "reports": reports,
    }


def _record(monitor: Any) -> list[list[list[float]]]:
    """The per-step reports the detector sees (for ``--dump``: misses can be replayed)."""
    reports: list[list[list[float]]] = []
    if monitor is None:
        return reports
    detector = monitor.detectors[0]
    observe = detector.observe

    def recording(report: Any) -> Any:
        reports.append([list(row) for row in report])
        return observe(report)

    detector.observe = recording
    return reports


def _timed_monitor(job: Any) -> None:
    """Accumulate the seconds spent inside the job's straggler monitor (the direct cost)."""
    monitor = job.timing.monitor
    if monitor is None:
        return
    inner = monitor.step
    job._monitor_seconds = job._monitor_cpu = 0.0

    def step(values: Any) -> Any:
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return inner(values)
        finally:
            job._monitor_seconds += time.perf_counter() - start
            job._monitor_cpu += time.thread_time() - cpu

    monitor.step = step


def _quiet() -> None:
    torch.set_num_threads(1)
    logging.getLogger("phalanx").setLevel(logging.ERROR)
    sys.stderr = open(os.devnull, "w")  # noqa: SIM115  (rank 0's progress bars)


def _draw(rng: random.Random, strategies: list[str], index: int) -> Injection:
    return Injection(
        rank=rng.randrange(WORLD),
        phase=rng.choice(PHASES),
        delay=rng.uniform(*DELAY_MS) / 1e3,
        onset=rng.randint(*ONSET),
        strategy=strategies[index % len(strategies)],
    )


def trials_worker(injections: list[Injection], setup: Setup) -> list[dict[str, Any]]:
    _quiet()
    return [_run(inj, setup, setup.every, seed=i) for i, inj in enumerate(injections)]


def clean_worker(runs: int, setup: Setup, strategies: list[str]) -> list[dict[str, Any]]:
    _quiet()
    return [
        _run(Injection(strategy=strategies[i % len(strategies)]), setup, setup.every, 1000 + i)
        for i in range(runs)
    ]


def ab_worker(jobs: int, setup: Setup, block: int) -> list[dict[str, Any]]:
    _quiet()
    out = []
    for i in range(jobs):  # _run times the monitor of these jobs (toggle > 0)
        out.append(_run(Injection(), setup, setup.every, seed=2000 + i, toggle=block))
    return out


def _score(injection: Injection, result: dict[str, Any]) -> dict[str, Any]:
    findings = result["findings"]
    first = findings[0] if findings else None
    early = first is not None and first["step"] < injection.onset
    right = first is not None and (first["rank"], first["phase"]) == (
        injection.rank,
        injection.phase,
    )
    latency = None if first is None else first["step"] - injection.onset
    ok = right and not early and latency is not None and latency <= WITHIN
    return {**asdict(injection), "ok": ok, "latency": latency, "first": first}


def _median_step(times: list[float]) -> float:
    return statistics.median(times[5:])  # the first steps include set-up


def _overhead(jobs: list[dict[str, Any]], args: Any) -> dict[str, Any]:
    """Median step time with the monitor over without, per job; and the time inside it."""
    ratios, on_ms, off_ms = [], [], []
    for job in jobs:
        steps = list(zip(job["times"], job["monitored"]))[5:]  # the first include set-up
        on = statistics.median(t for t, m in steps if m)
        off = statistics.median(t for t, m in steps if not m)
        ratios.append(on / off)
        on_ms.append(1e3 * on)
        off_ms.append(1e3 * off)
    monitored = [sum(job["monitored"]) for job in jobs]
    return {
        "jobs": len(jobs),
        "steps_each": args.ab_steps,
        "block": args.block,
        "median_step_ms_off": statistics.median(off_ms),
        "median_step_ms_on": statistics.median(on_ms),
        "ab_overhead": statistics.median(ratios) - 1,
        "ab_ratios": ratios,
        "monitor_wall_us_per_step": 1e6
        * statistics.median(j["monitor_s"] / n for j, n in zip(jobs, monitored)),
        "monitor_cpu_us_per_step": 1e6
        * statistics.median(j["monitor_cpu"] / n for j, n in zip(jobs, monitored)),
        "monitor_cpu_share_of_step": statistics.median(
            j["monitor_cpu"] / n / (o / 1e3) for j, n, o in zip(jobs, monitored, off_ms)
        ),
    }


def _trials(args: Any, strategies: list[str]) -> tuple[dict[str, Any], list[Any]]:
    from phalanx.testing import run_distributed

    rng = random.Random(args.seed)
    injections = [_draw(rng, strategies, i) for i in range(args.trials)]
    setup = Setup(STEPS, args.every, args.width, _rule(args))
    runs = run_distributed(trials_worker, injections, setup, world_size=WORLD, timeout=7200)[0]
    scored = [_score(inj, r) for inj, r in zip(injections, runs)]
    for s in scored:
        first = s["first"]
        named = "nobody" if first is None else f"rank {first['rank']} {first['phase']}"
        print(
            f"{'ok  ' if s['ok'] else 'MISS'} {s['strategy']:10s} rank {s['rank']} "
            f"{s['phase']:9s} {1e3 * s['delay']:4.0f} ms from step {s['onset']:2d}: "
            f"{named}, latency {s['latency']}",
            flush=True,
        )
    latencies = [s["latency"] for s in scored if s["ok"]]
    summary = {
        "n": len(scored),
        "named_right_within_5": sum(s["ok"] for s in scored),
        "latency_median": statistics.median(latencies) if latencies else None,
        "latency_max": max(latencies) if latencies else None,
        "misses": [s for s in scored if not s["ok"]],
    }
    dump = [{**asdict(inj), "reports": r["reports"]} for inj, r in zip(injections, runs)]
    return summary, dump


def _clean(args: Any, strategies: list[str]) -> tuple[dict[str, Any], list[Any]]:
    from phalanx.testing import run_distributed

    setup = Setup(args.clean_steps, args.every, args.width, _rule(args))
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        runs = run_distributed(
            clean_worker, args.clean, setup, strategies, world_size=WORLD, timeout=7200
        )[0]
    finally:
        hog.kill()
        hog.wait()
    named = [f for r in runs for f in r["findings"]]
    for f in named:
        print(f"clean run named: {f['line']}", flush=True)
    summary = {
        "runs": len(runs),
        "steps_each": args.clean_steps,
        "runs_naming_someone": sum(bool(r["findings"]) for r in runs),
        "findings": named,
        "median_step_ms": 1e3 * statistics.median(_median_step(r["times"]) for r in runs),
    }
    return summary, [r["reports"] for r in runs]


def _rule(args: Any) -> dict[str, Any]:
    """The ``StragglerRule`` fields given on the command line."""
    fields = {k: getattr(args, k) for k in ("patience", "quantile", "z", "min_ms", "relative")}
    rule = {k: v for k, v in fields.items() if v is not None}
    if "patience" in rule:
        rule["patience"] = int(rule["patience"])
    return rule


def _print_summary(result: dict[str, Any]) -> None:
    if "trials" in result:
        t = result["trials"]
        print(f"trials: {t['named_right_within_5']}/{t['n']} named right within {WITHIN} steps")
    if "clean_with_hog" in result:
        c = result["clean_with_hog"]
        print(f"clean runs with a CPU hog naming someone: {c['runs_naming_someone']}/{c['runs']}")
    if "overhead" in result:
        o = result["overhead"]
        print(
            f"overhead A/B: {100 * o['ab_overhead']:+.2f}% of step time; inside the monitor: "
            f"{o['monitor_wall_us_per_step']:.0f} us (wall), "
            f"{o['monitor_cpu_us_per_step']:.0f} us CPU = "
            f"{100 * o['monitor_cpu_share_of_step']:.2f}% of a step"
        )
    print("RESULT " + json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--clean", type=int, default=20)
    parser.add_argument("--clean-steps", type=int, default=60)
    parser.add_argument("--ab-jobs", type=int, default=6)
    parser.add_argument("--ab-steps", type=int, default=240)
    parser.add_argument("--block", type=int, default=4, help="A/B block length, in steps")
    parser.add_argument("--strategies", default="ddp", help="comma-separated, used in turn")
    parser.add_argument("--every", type=int, default=2, help="straggler_check_every")
    parser.add_argument("--width", type=int, default=768, help="hidden width of the MLP")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dump", help="write every run's per-step reports here (JSON)")
    for name in ("patience", "quantile", "z", "min_ms", "relative"):  # ablations of the rule
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, help="StragglerRule")
    args = parser.parse_args()
    from phalanx.testing import run_distributed

    strategies = args.strategies.split(",")
    result: dict[str, Any] = {
        "world_size": WORLD,
        "steps": STEPS,
        "every": args.every,
        "width": args.width,
        "strategies": strategies,
        "rule": _rule(args),
    }
    start, dumps = time.perf_counter(), {}
    if args.trials:
        result["trials"], dumps["trials"] = _trials(args, strategies)
    if args.clean:
        result["clean_with_hog"], dumps["clean"] = _clean(args, strategies)
    if args.ab_jobs:
        setup = Setup(args.ab_steps, args.every, args.width, _rule(args))
        jobs = run_distributed(
            ab_worker, args.ab_jobs, setup, args.block, world_size=WORLD, timeout=7200
        )[0]
        result["overhead"] = _overhead(jobs, args)
    result["seconds"] = time.perf_counter() - start
    result["machine"] = f"{os.cpu_count()} CPUs, torch {torch.__version__}, gloo"
    if args.dump:
        with open(args.dump, "w") as f:
            json.dump(dumps, f)
    _print_summary(result)


if __name__ == "__main__":
    main()
