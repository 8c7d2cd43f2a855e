"""``phalanx diagnose DIR``: merge the ranks' flight records and name the first divergence.

Ranks write ``DIR/rank-<r>.json`` when ``PHALANX_DUMP_DIR=DIR`` is set and a hang is reported
or a collective fails (see :mod:`.watchdog`). torch's Flight Recorder dumps (``<prefix><rank>``,
pickle or JSON; see :mod:`.torch_flight`) in DIR, or named as files, are read too, so a torch
job (NCCL included) gets the same analysis. Exit code 0 when the records agree, 1 when they
diverge, 2 without dumps or for an unreadable one.
"""

from __future__ import annotations

import argparse
import sys

from phalanx.comm.dumps import read_dumps
from phalanx.comm.flight import first_divergence

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Print each rank's last collective and the first diverging one; returns the exit code."""
    parser = argparse.ArgumentParser(prog="phalanx diagnose", description=__doc__.splitlines()[0])
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
    div = first_divergence(records)
    if div is None:
        print("no divergence: every rank issued the same collectives from the same call sites")
        return 0
    print("first divergence: " + div.describe())
    return 1
