"""The ``phalanx`` command: ``run``, ``bench``, ``plan``, ``doctor``, ``diagnose``,
``checkpoint``."""

from __future__ import annotations

import importlib
import os
import signal
import sys

from phalanx._optional import MissingExtraError

__all__ = ["main"]

USAGE = """usage: phalanx <command> [args]

commands:
  run      launch a training script on N processes / machines (torchrun's flags)
  bench    benchmarks: `phalanx bench SUITE [--quick] [--out DIR] [--json PATH]`, ours against
           torch or the methods against each other in the same run (`phalanx bench --help`
           lists the suites and the flags every one takes)
  plan     model-state memory per device for DDP and ZeRO-1/2/3 (the ZeRO paper's formulas)
  doctor   check torch, backends, GPUs, network interfaces and ports, and say which backend
           `phalanx run` gives the workers and why
  diagnose DIR: merge the ranks' flight records (PHALANX_DUMP_DIR, or torch's Flight Recorder
           dumps: their directory or files) and print the first collective where they diverge
  timeline RUN [-o trace.json]: one Chrome / Perfetto trace of every rank of a job recorded with
           `phalanx run --timeline RUN` or Job(timeline_dir=RUN), clock-aligned, with each
           step's critical path (which rank and phase the step waited on)
  verify   --mode resume|strategy|world SCRIPT: run a training script twice (resumed, under
           another strategy, at another world size) and name the first step and tensor whose
           difference exceeds the measured rounding noise
  checkpoint convert SRC DST (--to | --from) {dcp,hf}: phalanx checkpoints to / from torch
           DCP and Hugging Face safetensors weights
"""


def _bench_help() -> str:
    """``phalanx bench --help``: the suites, one line each, and the flags every suite takes."""
    from phalanx.bench import SUITES
    from phalanx.bench.common import COMMON_FLAGS

    width = max(len(name) for name in [*SUITES, *(flag for flag, _ in COMMON_FLAGS)]) + 2
    lines = [
        "usage: phalanx bench SUITE [--quick] [--out DIR] [--json PATH] [SUITE's flags]",
        "",
        "phalanx against the torch-native equivalent (or methods against each other), "
        "interleaved in",
        "one run; prints a table, writes DIR/SUITE.json and ends with one line RESULT {json}.",
        "",
        "suites:",
        *(f"  {name:<{width}}{what}" for name, what in SUITES.items()),
        "",
        "flags every suite takes:",
        *(f"  {flag:<{width}}{what}" for flag, what in COMMON_FLAGS),
        f"  {'-h, --help':<{width}}after SUITE: that suite's own flags too",
        "",
        "--out benchmarks/results regenerates the figures the docs cite.",
    ]
    return "\n".join(lines) + "\n"


def _bench(argv: list[str]) -> int:
    from phalanx.bench import SUITES

    if not argv or argv[0] in ("-h", "--help"):
        print(_bench_help(), end="", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    suite = argv[0]
    if suite not in SUITES:
        print(
            f"phalanx bench: unknown suite {suite!r}; one of {', '.join(SUITES)} "
            "(phalanx bench --help)",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(f"phalanx.bench.{suite}")
    try:
        return int(module.main(argv[1:]))
    except MissingExtraError as exc:  # raised before the benchmark starts any work
        print(f"phalanx bench {suite}: error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``phalanx`` console script; returns the exit code.

    A reader that stops reading (``phalanx plan ... | head -2``) ends the command quietly,
    with the status a shell gives a process killed by SIGPIPE (141), not a traceback.
    """
    try:
        return _dispatch(sys.argv[1:] if argv is None else argv)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's flush at exit fails no more
        return 128 + signal.SIGPIPE


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "run":
        from phalanx import launch

        return launch.main(rest)
    if command == "bench":
        return _bench(rest)
    if command == "plan":
        from phalanx.plan import cli as plan_cli

        return plan_cli.main(rest)
    if command == "doctor":
        from phalanx import doctor

        return doctor.main(rest)
    if command == "diagnose":
        if "--ledger" in rest:  # the sample ledger's audit lives with the data it reads
            from phalanx.data import ledger_cli

            return ledger_cli.main(rest)
        from phalanx.diagnostics import diagnose_cli

        return diagnose_cli.main(rest)
    if command == "timeline":
        from phalanx.diagnostics import timeline_cli

        return timeline_cli.main(rest)
    if command == "verify":
        from phalanx.diagnostics.verify import cli as verify_cli

        return verify_cli.main(rest)
    if command == "checkpoint":
        from phalanx.checkpoint import convert_cli

        return convert_cli.main(rest)
    if command in ("--version", "version"):
        from phalanx import __version__

        print(f"phalanx {__version__}")
        return 0
    print(f"phalanx: unknown command {command!r}\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
