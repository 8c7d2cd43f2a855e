"""``phalanx diagnose DIR``: merge the ranks' flight records and name the first divergence.

Ranks write ``DIR/rank-<r>.json`` when ``PHALANX_DUMP_DIR=DIR`` is set and a hang is reported
or a collective fails (see :mod:`.watchdog`). Exit code 0 when the records agree, 1 when they
diverge, 2 for a directory without dumps.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from phalanx.comm.flight import first_divergence, load_dump

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Print each rank's last collective and the first diverging one; returns the exit code."""
    parser = argparse.ArgumentParser(prog="phalanx diagnose", description=__doc__.splitlines()[0])
    parser.add_argument("dir", help="the PHALANX_DUMP_DIR the ranks wrote to")
    args = parser.parse_args(argv)
    paths = sorted(Path(args.dir).glob("rank-*.json"))
    if not paths:
        print(f"phalanx diagnose: no rank-*.json dumps in {args.dir}", file=sys.stderr)
        return 2
    records = dict(load_dump(p) for p in paths)
    for rank, recs in sorted(records.items()):
        last = recs[-1] if recs else None
        state = (
            "none"
            if last is None
            else (
                f"{last.where()} (#{last.seq} on group {last.group}, "
                f"{'completed' if last.end is not None else 'in flight'})"
            )
        )
        print(f"rank {rank}: {len(recs)} collectives recorded; last: {state}")
    div = first_divergence(records)
    if div is None:
        print("no divergence: every rank issued the same collectives from the same call sites")
        return 0
    print("first divergence: " + div.describe())
    return 1
