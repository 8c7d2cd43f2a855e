"""Plant and catch: does ``phalanx verify`` catch each planted bug, and stay quiet on clean pairs?

    python tools/plant_and_catch/run.py [--repeats 20] [--clean 20] [--steps 12] [--only NAME]

For each bug of ``plants.py`` it runs ``phalanx verify`` on ``train.py`` ``--repeats`` times
(each with its own seed), the bug planted in the checked run(s) only, in the mode that can see
it; a catch is exit status 1 with the divergence in the expected value (and, for a resume, not
before the resumed step). Then ``--clean`` unplanted verifications per mode, each of which must
exit 0. It prints one line per verification and ends with ``RESULT {json}``: per bug the
catches out of the runs, per mode the false alarms out of the clean pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train.py"


@dataclass(frozen=True)
class Case:
    """One kind of verification: its mode, flags, script arguments and what a catch names."""

    mode: str
    flags: tuple[str, ...] = ()
    script_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    expect: tuple[str, ...] = ()
    """The divergence's value name starts with one of these."""
    from_resume: bool = False
    """The divergence comes at or after the resumed step (the run is identical before it)."""


WORLD = Case("world", ("--world", "4"), ("--dropout", "0"))
STRATEGY = Case("strategy", ("--strategy", "zero2", "--against", "ddp"), ("--grad-accum", "2"))
RESUME = Case("resume")

BUGS = {
    "sampler_repeat": Case("resume", expect=("loss", "grad/"), from_resume=True),
    "rng_not_restored": Case("resume", expect=("loss", "grad/"), from_resume=True),
    "grad_scale_world4": Case(WORLD.mode, WORLD.flags, WORLD.script_args, expect=("grad/",)),
    "missed_no_sync": Case(STRATEGY.mode, STRATEGY.flags, STRATEGY.script_args, expect=("grad/",)),
    "buffer_not_broadcast": Case(  # rank 1 computes with its own buffer: the loss differs first
        "strategy", ("--strategy", "ddp", "--against", "ddp"), expect=("loss", "model/projection")
    ),
    "zero_shard_order": Case(
        "resume", env={"PHALANX_STRATEGY": "zero2"}, expect=("optimizer/",), from_resume=True
    ),
    "scheduler_twice": Case("resume", expect=("optimizer/group0/lr",), from_resume=True),
}
CLEAN = {"resume": RESUME, "strategy": STRATEGY, "world": WORLD}


def verify(case: Case, seed: int, steps: int, plant: str | None) -> tuple[int, dict[str, object]]:
    """Run ``phalanx verify`` for ``case``; its exit status and its JSON result."""
    with tempfile.TemporaryDirectory(prefix="plant-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "phalanx", "verify", "--mode", case.mode, *case.flags]
        cmd += ["--steps", str(steps), "--json", str(out)]
        if plant:
            cmd += ["--checked-env", f"PHALANX_PLANT={plant}"]
        cmd += [str(TRAIN), *case.script_args, "--seed", str(seed)]
        env = {**os.environ, **case.env}
        done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode not in (0, 1):
            return done.returncode, {"error": (done.stdout + done.stderr)[-2000:]}
        return done.returncode, json.loads(out.read_text())


def caught(case: Case, code: int, result: dict[str, object], steps: int) -> tuple[bool, str]:
    """Whether the verification caught the bug where it should, and what it named."""
    found = result.get("divergence")
    if code != 1 or not isinstance(found, dict):
        return False, f"exit {code}: {result.get('error', 'no divergence')}"
    name, step = str(found["name"]), int(found["step"])
    said = f"step {step}: {name}"
    if not name.startswith(case.expect):
        return False, f"{said} (expected {' or '.join(case.expect)})"
    if case.from_resume and step <= steps // 2:
        return False, f"{said} (before the resumed step {steps // 2 + 1})"
    return True, said


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="verifications per bug")
    parser.add_argument("--clean", type=int, default=20, help="clean verifications per mode")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--only", help="only this bug (or clean-<mode>)")
    args = parser.parse_args(argv)
    result: dict[str, dict[str, int]] = {}
    for name, case in BUGS.items():
        if args.only and args.only != name:
            continue
        hits = 0
        for seed in range(args.repeats):
            start = time.monotonic()
            code, found = verify(case, seed, args.steps, name)
            ok, said = caught(case, code, found, args.steps)
            hits += ok
            took = time.monotonic() - start
            print(f"{name:22} seed {seed:2} {'caught' if ok else 'MISSED'}  {said}  ({took:.0f} s)")
        result[name] = {"caught": hits, "runs": args.repeats}
    for mode, case in CLEAN.items():
        if args.only and args.only != f"clean-{mode}":
            continue
        alarms = 0
        for seed in range(args.clean):
            start = time.monotonic()
            code, found = verify(case, 100 + seed, args.steps, None)
            quiet = code == 0
            alarms += not quiet
            div = found.get("divergence") or found.get("error", "")
            took = time.monotonic() - start
            verdict = "quiet" if quiet else "ALARM"
            print(f"clean-{mode:16} seed {seed:2} {verdict}  {div}  ({took:.0f} s)")
        result[f"clean-{mode}"] = {"false_alarms": alarms, "runs": args.clean}
    print("RESULT " + json.dumps(result))
    missed = any(r.get("caught", 0) < r.get("runs", 0) for r in result.values() if "caught" in r)
    alarmed = any(r.get("false_alarms", 0) for r in result.values())
    return 1 if missed or alarmed else 0


if __name__ == "__main__":
    sys.exit(main())
