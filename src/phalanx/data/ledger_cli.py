"""``phalanx diagnose --ledger PATH``: audit a live job's sample ledger, epoch by epoch.

PATH is a ledger written as JSON (``SampleLedger.to_dict()``), or a live job's checkpoint
directory, whose newest checkpoint holds the ledger of every step it committed. Prints each
epoch's samples trained and, for a faulty epoch, the missing, repeated (with the steps and ranks
that trained them) and unexpected ones. Exit code 0 when every epoch trained every sample
exactly once, 1 otherwise, 2 when PATH holds no ledger.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from phalanx.data.ledger import SampleLedger

__all__ = ["audit", "main", "read_ledger"]


def read_ledger(path: Path) -> SampleLedger:
    """The ledger in ``path`` (a JSON file, or a checkpoint directory of a live job).

    Raises:
        ValueError: ``path`` holds no ledger (named, with what was looked for).
    """
    if path.is_dir():
        from phalanx.checkpoint import catalog

        newest = catalog.latest(path)
        if newest is None:
            raise ValueError(f"{path}: no committed checkpoint (looked for a live job's ledger)")
        data: Any = json.loads((newest / "manifest.json").read_text()).get("extra", {})
        data = data.get("ledger") if isinstance(data, dict) else None
        if data is None:
            raise ValueError(f"{newest}: the checkpoint holds no sample ledger (not a live job)")
    else:
        data = json.loads(path.read_text())
    return SampleLedger.from_dict(data)


def audit(path: Path) -> int:
    """Print the audit of the ledger in ``path``; returns the exit code."""
    try:
        ledger = read_ledger(path)
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"phalanx diagnose --ledger: {exc}\n")
        return 2
    faulty = 0
    for epoch in ledger.epochs:
        result = ledger.audit(epoch)
        problems = result.problems()
        faulty += bool(problems)
        state = "every sample exactly once" if not problems else f"{len(problems)} problem(s)"
        print(f"epoch {epoch}: {result.trained} samples trained: {state}")
        for line in problems:
            print(f"  {line}")
    if not ledger.epochs:
        print("the ledger records no committed step")
    return 1 if faulty else 0


def main(argv: list[str] | None = None) -> int:
    """``phalanx diagnose --ledger PATH...``: audit each ledger; returns the worst exit code."""
    parser = argparse.ArgumentParser(prog="phalanx diagnose", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--ledger",
        action="store_true",
        required=True,
        help="audit the sample ledger in PATH (a live job's checkpoint directory, or a JSON file)",
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="a ledger or checkpoint directory")
    args = parser.parse_args(argv)
    return max(audit(Path(p)) for p in args.paths)
