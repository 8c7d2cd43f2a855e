"""The ``phalanx`` command: ``run``, ``bench``, ``plan``, ``doctor``, ``diagnose``,
``checkpoint``."""

from __future__ import annotations

import argparse
import importlib
import sys

from phalanx._optional import MissingExtraError

__all__ = ["main"]

SUITES = (
    "comm",
    "ddp",
    "checkpoint",
    "zero",
    "zero_hybrid",
    "pipeline",
    "tensor_parallel",
    "param_server",
    "low_bandwidth",
    "hosts_backend",
)

USAGE = """usage: phalanx <command> [args]

commands:
  run      launch a training script on N processes / machines (torchrun's flags)
  bench    benchmarks: `phalanx bench SUITE [--quick] [--out DIR]`, SUITE one of comm, ddp,
           checkpoint, zero, zero_hybrid, pipeline, tensor_parallel, param_server,
           low_bandwidth, hosts_backend (ours vs torch or the methods against each other, same run;
           results in DIR, default a new runs/bench-SUITE-<timestamp>/)
  plan     model-state memory per device for DDP and ZeRO-1/2/3 (the ZeRO paper's formulas)
  doctor   check torch, backends, GPUs, network interfaces and ports
  diagnose DIR: merge the ranks' flight records (PHALANX_DUMP_DIR, or torch's Flight Recorder
           dumps: their directory or files) and print the first collective where they diverge
  checkpoint convert SRC DST (--to | --from) {dcp,hf}: phalanx checkpoints to / from torch
           DCP and Hugging Face safetensors weights
"""


def _bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="phalanx bench", add_help=True)
    parser.add_argument("suite", choices=SUITES, help="which benchmark to run")
    suite = parser.parse_args(argv[:1]).suite
    module = importlib.import_module(f"phalanx.bench.{suite}")
    try:
        return int(module.main(argv[1:]))
    except MissingExtraError as exc:  # raised before the benchmark starts any work
        print(f"phalanx bench {suite}: error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``phalanx`` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
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
        from phalanx.comm import diagnose_cli as diagnose

        return diagnose.main(rest)
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
