"""``phalanx diagnose DIR``: merge the ranks' flight records and name the first divergence.

Ranks write ``DIR/rank-<r>.json`` when ``PHALANX_DUMP_DIR=DIR`` is set and a hang is reported
or a collective fails (see :mod:`.watchdog`). torch's Flight Recorder dumps (``<prefix><rank>``,
pickle or JSON; see :mod:`.torch_flight`) in DIR, or named as files, are read too, so a torch
job (NCCL included) gets the same analysis. It prints where each rank's record stops (ranks at
different steps are behind, not diverged) and the first collective the ranks paired wrongly
(:mod:`.pairing`). Exit code 0 when the records agree, 1 when they diverge, 2 without dumps or
for an unreadable one.

``phalanx diagnose --ledger PATH`` audits a live job's sample ledger instead: ``phalanx.cli``
hands it to :mod:`phalanx.data.ledger_cli`, which lives with the data it reads (the diagnostics
import neither the data nor the checkpoints).
"""

from __future__ import annotations

import argparse
import sys

from phalanx.diagnostics.dumps import read_dumps
from phalanx.diagnostics.flight import Record
from phalanx.diagnostics.pairing import first_divergence

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Print each rank's last collective and the first diverging one; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="phalanx diagnose",
        description=__doc__.splitlines()[0],
        epilog="phalanx diagnose --ledger PATH...: audit the sample ledger in PATH (a live job's "
        "checkpoint directory, or a JSON file) instead",
    )
    parser.add_argument(
        "paths",
        nargs="+",
        metavar="DIR",
        help="the PHALANX_DUMP_DIR the ranks wrote to, or torch's dump files or their directory",
    )
    args = parser.parse_args(argv)
    try:
        records, notes = read_dumps(args.paths)
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"phalanx diagnose: {exc}\n")
        return 2
    if not records:
        sys.stderr.write(
            f"phalanx diagnose: no dumps in {' '.join(args.paths)} (phalanx's rank-<r>.json, "
            "or torch Flight Recorder files <prefix><rank>)\n"
        )
        return 2
    sys.stdout.write("".join(f"{line}\n" for line in notes))
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
    for line in _stops(records):
        print(line)
    div = first_divergence(records)
    if div is None:
        print("no divergence: at every position all ranks reached, they issued matching calls")
        return 0
    print("first divergence: " + div.describe())
    return 1


def _stops(records: dict[int, list[Record]]) -> list[str]:
    """Per group where the ranks' records stop, when they stop at different positions."""
    lines = []
    for group in sorted({r.group for recs in records.values() for r in recs}):
        last = {
            rank: max((r.seq for r in recs if r.group == group), default=0)
            for rank, recs in records.items()
        }
        if len(set(last.values())) > 1:
            ahead = max(last.values())
            behind = sorted(r for r, n in last.items() if n < ahead)
            lines.append(
                f"group {group}: rank(s) {behind} stop before #{ahead}, which rank(s) "
                f"{sorted(r for r, n in last.items() if n == ahead)} issued: behind (still "
                f"working, stuck or dead), not diverged"
            )
    return lines
