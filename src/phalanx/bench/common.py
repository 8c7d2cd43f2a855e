"""What every benchmark shares: a collective-aware timer and where its numbers go.

Every benchmark writes into one directory, ``--out DIR``, by default a new
``runs/bench-<suite>-<YYYYmmdd-HHMMSS>/`` under the current directory (git-ignored in the
repository), so a run never overwrites earlier results, committed ones included. Regenerating
the files the docs cite is explicit: ``--out benchmarks/results``. Each row is printed and
appended to ``DIR/rows.jsonl`` as soon as it is measured, so an interrupted run keeps what it
measured; at the end ``DIR/<suite>.json`` gets the whole result and the last line printed is
``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "COMMON_FLAGS",
    "Output",
    "add_common_flags",
    "add_output_flags",
    "at_least_one",
    "default_out",
    "timed",
]


def timed(fn: Callable[[], None]) -> float:
    """Seconds ``fn`` took on the slowest rank, started together after a barrier."""
    import torch

    import phalanx

    phalanx.barrier()
    start = time.perf_counter()
    fn()
    took = torch.tensor([time.perf_counter() - start])
    phalanx.all_reduce(took, phalanx.ReduceOp.MAX)
    return float(took)


def at_least_one(parser: argparse.ArgumentParser, args: argparse.Namespace, *flags: str) -> None:
    """Fail the command line (``parser.error``) when any of ``flags`` (attribute names of
    ``args``) is below 1, naming the flag and its value."""
    for flag in flags:
        value = getattr(args, flag)
        if value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")


def default_out(suite: str, root: str | Path = "runs", now: float | None = None) -> Path:
    """Make a new directory ``root/bench-<suite>-<timestamp>[-N]`` and return it.

    Created exclusively, so two runs started in the same second never share one.
    """
    base = Path(root) / f"bench-{suite}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}"
    base.parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        path = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise AssertionError("unreachable")


COMMON_FLAGS = (
    ("--quick", "a short run with small sizes: a smoke test, not figures to cite"),
    ("--out DIR", "where results go (default: a new runs/bench-SUITE-<timestamp>/)"),
    ("--json PATH", "also write the result (DIR/SUITE.json) here"),
)
"""The flags every suite of ``phalanx bench`` takes, with what they do (its ``--help``)."""


def add_common_flags(parser: argparse.ArgumentParser, suite: str, quick: str) -> None:
    """The flags of :data:`COMMON_FLAGS`: ``--quick`` (``quick`` says what it runs in this
    suite), ``--out DIR`` and ``--json PATH`` (:func:`add_output_flags`)."""
    parser.add_argument("--quick", action="store_true", help=quick)
    add_output_flags(parser, suite)


def add_output_flags(parser: argparse.ArgumentParser, suite: str) -> None:
    """``--out DIR`` (default: a new ``runs/bench-<suite>-<timestamp>/``) and ``--json PATH``."""
    parser.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help=f"where the results go (default: a new runs/bench-{suite}-<timestamp>/)",
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the result here")


@dataclass(frozen=True)
class Output:
    """Where one benchmark run's numbers go (picklable: ranks can write rows too).

    Build it with :meth:`create` from the parsed ``--out`` / ``--json`` flags.
    """

    suite: str
    directory: Path
    json_path: str | None = None

    @classmethod
    def create(cls, suite: str, out: str | None, json_path: str | None = None) -> Output:
        """Make ``out`` (or a new default directory) and say where the numbers will go."""
        if out:
            directory = Path(out)
            directory.mkdir(parents=True, exist_ok=True)
        else:
            directory = default_out(suite)
        print(f"phalanx bench {suite}: results go to {directory}/", flush=True)
        return cls(suite, directory, json_path)

    def path(self, name: str) -> Path:
        """A file of this run's directory (a plot, say)."""
        return self.directory / name

    def rows(self, rows: Iterable[dict[str, Any]]) -> None:
        """Print ``rows`` and append them to ``rows.jsonl``, as soon as they are measured.

        Called on every rank of a benchmark's job, or in the parent; only rank 0 records.
        """
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return
        with open(self.path("rows.jsonl"), "a") as f:
            for row in rows:
                shown = ", ".join(f"{k}={_short(v)}" for k, v in row.items() if _scalar(v))
                print(f"  measured: {shown}", flush=True)
                f.write(json.dumps(row) + "\n")
                f.flush()

    def write(self, payload: dict[str, Any]) -> None:
        """Write everything measured to ``<suite>.json`` (and to ``--json PATH``)."""
        text = json.dumps(payload, indent=1)
        self.path(f"{self.suite}.json").write_text(text)
        if self.json_path:
            Path(self.json_path).write_text(text)

    def result(self, payload: dict[str, Any], line: dict[str, Any] | None = None) -> None:
        """:meth:`write` ``payload``, then print the benchmark's last line, ``RESULT {json}``
        of ``line`` (default: the payload)."""
        self.write(payload)
        print("RESULT " + json.dumps(payload if line is None else line), flush=True)


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
