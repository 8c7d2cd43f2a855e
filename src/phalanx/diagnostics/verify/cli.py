"""``phalanx verify``: run a training script twice and name the first step that diverges.

    phalanx verify --mode resume   [--steps 20] [--at 10] [--nproc-per-node 2] train.py [args]
    phalanx verify --mode strategy --strategy zero3 [--against ddp] [--nproc-per-node 2] train.py
    phalanx verify --mode world    --world 4 [--nproc-per-node 2] train.py

Every run is ``phalanx run --standalone --nproc-per-node N SCRIPT ARGS`` with the probe of
:mod:`.probe` on, for ``--steps`` optimizer steps. The modes:

- ``resume``: the reference trains without a stop; the checked run saves at step ``--at`` and
  exits, and a third run resumes from that checkpoint to the end (the script must make its
  ``phalanx.Job`` with a ``checkpoint_dir``; each run gets a fresh one). Resuming is exact, so
  the noise is measured by training the reference twice.
- ``strategy``: the reference runs under ``--against`` (default: the script's own strategy),
  the checked run under ``--strategy`` (a name such as ``zero3`` or a call such as
  ``'Mesh(tp=2)'``; see ``PHALANX_STRATEGY`` in :mod:`phalanx.train.strategies.registry`).
- ``world``: the reference at ``--nproc-per-node`` ranks, the checked run at ``--world``, with
  each rank's batch scaled to keep the global batch (``PHALANX_BATCH_REPLICAS``).

In ``strategy`` and ``world`` the noise is measured by a twin of the reference whose gradients
are moved by one unit in the last place before each step, the rounding a reordered reduction
makes. Then each step's values are compared (:mod:`.compare`). Exit status: 0 when no
value left the bound, 1 at a divergence (the step, the value's name, both values), 2 when a run
failed or the arguments are wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from phalanx.diagnostics.verify import probe
from phalanx.diagnostics.verify.compare import (
    FACTOR,
    Divergence,
    Run,
    StepReport,
    compare,
)
from phalanx.train.job_data import BATCH_REPLICAS_VAR
from phalanx.train.strategies.registry import OVERRIDE_VAR, parse_strategy

__all__ = ["ROUNDING_FLOOR", "Verification", "main", "verify"]

ROUNDING_FLOOR = 1e-6
"""The least bound of ``strategy`` and ``world`` (about 8 units in the last place of fp32): a
pair whose twin happened to round identically still allows what reordering does."""

MODES = ("resume", "strategy", "world")
CHECKED = ("checked", "saved", "resumed")
"""The runs a verification checks against the reference (a resume's two halves)."""


@dataclass(frozen=True)
class Planned:
    """One run of a verification: its name, ranks and environment."""

    name: str
    nproc: int
    env: dict[str, str]


@dataclass(frozen=True)
class Verification:
    """What ``phalanx verify`` found."""

    mode: str
    title: str
    steps: list[StepReport]
    divergence: Divergence | None

    def to_json(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "title": self.title,
            "steps": [asdict(s) for s in self.steps],
            "divergence": None if self.divergence is None else asdict(self.divergence),
        }


def _plan(args: argparse.Namespace, root: Path) -> tuple[list[Planned], str, float]:
    """The runs of ``args.mode`` (reference, twin, checked...), the title and the floor."""
    n, steps = args.nproc_per_node, str(args.steps)
    checked_env = dict(args.checked_env)

    def env(name: str, **extra: str) -> dict[str, str]:
        # Each run checkpoints into a folder of its own (never the script's, which would
        # resume one run from another's checkpoint), except the two halves of a resume.
        fresh = {probe.ENV_CHECKPOINTS: str(root / name / "checkpoints")}
        own = checked_env if name in CHECKED else {}
        return {probe.ENV_DIR: str(root / name), probe.ENV_STEPS: steps, **fresh, **own, **extra}

    if args.mode == "resume":
        at = args.at if args.at is not None else max(1, args.steps // 2)
        if not 1 <= at < args.steps:
            raise ValueError(f"--at {at} must be in 1..{args.steps - 1} (--steps {args.steps})")
        ckpt = {probe.ENV_CHECKPOINTS: str(root / "resumed-checkpoints")}
        runs = [
            Planned("reference", n, env("reference")),
            Planned("twin", n, env("twin")),
            Planned("saved", n, env("saved", **{probe.ENV_SAVE_AT: str(at)}, **ckpt)),
            Planned("resumed", n, env("resumed", **ckpt)),
        ]
        return runs, f"resumed at step {at} against uninterrupted, {n} ranks", 0.0
    perturbed = {probe.ENV_PERTURB: "1"}
    if args.mode == "strategy":
        if args.strategy is None:
            raise ValueError("--mode strategy needs --strategy NAME (e.g. zero3, 'Mesh(tp=2)')")
        checked = {OVERRIDE_VAR: args.strategy}
        reference = {OVERRIDE_VAR: args.against} if args.against else {}
        for flag, given in (("--strategy", args.strategy), ("--against", args.against)):
            if given is not None:
                parse_strategy(given, flag)
        runs = [
            Planned("reference", n, env("reference", **reference)),
            Planned("twin", n, env("twin", **reference, **perturbed)),
            Planned("checked", n, env("checked", **checked)),
        ]
        against = args.against or "the script's strategy"
        return runs, f"{args.strategy} against {against}, {n} ranks", ROUNDING_FLOOR
    if args.world is None:
        raise ValueError("--mode world needs --world N (the other world size)")
    batch = {BATCH_REPLICAS_VAR: str(n)}
    runs = [
        Planned("reference", n, env("reference", **batch)),
        Planned("twin", n, env("twin", **batch, **perturbed)),
        Planned("checked", args.world, env("checked", **batch)),
    ]
    return runs, f"{args.world} ranks against {n} at the same global batch", ROUNDING_FLOOR


def _launch(run: Planned, script: list[str], root: Path, timeout: float) -> None:
    """Run ``script`` under ``phalanx run``; raise ``RuntimeError`` with its output's tail."""
    cmd = [sys.executable, "-m", "phalanx", "run", "--standalone", "--nproc-per-node"]
    cmd += [str(run.nproc), *script]
    env = {**os.environ, **run.env}
    log = root / f"{run.name}.log"
    with open(log, "w") as out:
        try:
            done = subprocess.run(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout
            )
            code: int | str = done.returncode
        except subprocess.TimeoutExpired:
            code = f"a timeout ({timeout:.0f} s)"
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-25:])
        raise RuntimeError(f"the {run.name} run ended with {code} ({log}):\n{tail}")


def verify(args: argparse.Namespace, root: Path, say: object = print) -> Verification:
    """Make the runs ``args`` asks for in ``root`` and compare them."""
    runs, title, floor = _plan(args, root)
    script = [args.script, *args.script_args]
    for run in runs:
        say(f"phalanx verify: {run.name} run ({run.nproc} ranks)")  # type: ignore[operator]
        _launch(run, script, root, args.timeout)
    read = {run.name: Run.read(root / run.name) for run in runs}
    checked = [read[name] for name in CHECKED if name in read]
    reports, found = compare(read["reference"], read["twin"], checked, floor, args.factor)
    return Verification(args.mode, title, reports, found)


def report(result: Verification) -> str:
    """The verification as text: one line per step, then the verdict."""
    lines = [f"phalanx verify --mode {result.mode}: {result.title}"]
    lines.append(f"{'step':>5} {'difference':>11} {'bound':>10}  largest in")
    for s in result.steps:
        mark = "  <-- diverged" if s.diverged else ""
        worst = s.worst if s.difference > 0 else "-"
        lines.append(f"{s.step:>5} {s.difference:>11.3g} {s.bound:>10.3g}  {worst}{mark}")
    d = result.divergence
    if d is None:
        lines.append(f"no divergence: every value of {len(result.steps)} steps within the bound")
    else:
        lines.append(
            f"DIVERGED at step {d.step}: {d.name} differs by {d.difference:.3g} "
            f"(bound {d.bound:.3g})\n  reference: {d.reference}\n  checked:   {d.other}"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="phalanx verify",
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--mode", choices=MODES, required=True, help="what the two runs differ in")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run (default 20)")
    p.add_argument("--at", type=int, default=None, help="resume: the step saved and resumed")
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks of the reference")
    p.add_argument("--strategy", help="strategy: the checked run's strategy")
    p.add_argument("--against", help="strategy: the reference's (default: the script's)")
    p.add_argument("--world", type=int, help="world: the checked run's number of ranks")
    p.add_argument("--factor", type=float, default=FACTOR, help="bound = factor x noise")
    p.add_argument("--keep", help="keep the runs' records in this folder (default: a temp one)")
    p.add_argument("--json", help="also write the result as JSON to this file")
    p.add_argument("--plot", help="draw each step's difference and bound into this PNG")
    p.add_argument(
        "--checked-env",
        action="append",
        default=[],
        type=_assignment,
        metavar="KEY=VALUE",
        help="an environment variable of the checked run(s) only (repeatable): what to verify "
        "a setting against the reference without it",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("script", help="the training script (it makes a phalanx.Job)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def _assignment(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"--checked-env {text!r} is not KEY=VALUE")
    return key.strip(), value


def _check(args: argparse.Namespace) -> None:
    for name in ("steps", "nproc_per_node", "world"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value} must be at least 1")
    if not args.factor > 0:
        raise ValueError(f"--factor {args.factor} must be positive")
    if not Path(args.script).is_file():
        raise ValueError(f"the script {args.script!r} does not exist")


def main(argv: list[str] | None = None) -> int:
    """``phalanx verify``; returns the exit status (0 agree, 1 diverged, 2 error)."""
    args = _parser().parse_args(argv)
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="phalanx-verify-"))
    try:
        _check(args)
        if args.keep:
            if root.exists() and any(root.iterdir()):
                raise ValueError(f"--keep {args.keep}: the folder is not empty")
            root.mkdir(parents=True, exist_ok=True)
        result = verify(args, root)
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        print(f"phalanx verify: {exc}", file=sys.stderr)
        return 2
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_json(), indent=1))
    if args.plot:
        from phalanx.diagnostics.verify.plot import plot_divergence

        plot_divergence(result, args.plot)
    return 0 if result.divergence is None else 1


if __name__ == "__main__":
    sys.exit(main())
