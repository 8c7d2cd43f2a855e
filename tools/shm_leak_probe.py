"""SIGKILL every rank of an shm group in its creation window, N times; count what /dev/shm keeps.

Usage: python tools/shm_leak_probe.py [--tries 100] [--world-size 2] [--named | --legacy]

Each try starts ``--world-size`` ranks (a forkserver that imported torch once) that make a
``backend="shm"`` group. Rank 0's segment creation is wrapped: right after the segment exists,
before any peer has mapped it, rank 0 tells the probe and blocks, and the probe SIGKILLs every
rank at once. That is the window issue 34 aimed at (4 leaks in 8 tries before). After the
ranks are gone the probe looks in /dev/shm for the segment its rank 0 made (by the name rank 0
wrote down: a file's, or a memfd's label) and removes it, so that the next try starts clean.
Other new ``phalanx-shm-<uid>-*`` files (another job on the machine) are counted apart.

- default: the code as it is (a memfd where rank 0 sees its peers' processes);
- ``--named``: the fallback for ranks in other pid namespaces (a named file in /dev/shm);
- ``--legacy``: the code before issue 34 (``segment._create``), with ``PYTHONPATH`` pointing
  at such a tree.

Prints one line per 10 tries and ends with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

PREFIX = f"phalanx-shm-{os.getuid()}-"


def _leftovers() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(PREFIX)}


def _hook(mode: str, created: Any, note: str) -> None:
    """Make rank 0 stop right after its segment exists (and say so, with its name if any)."""

    def park(name: str = "") -> None:
        with open(note, "w") as f:
            f.write(name)
        created.set()
        while True:
            time.sleep(60)

    if mode == "legacy":
        from phalanx.comm.shm import segment

        old = getattr(segment, "_create")  # noqa: B009  (that tree's private function)

        def legacy(nbytes: int) -> Any:
            made = old(nbytes)
            park(made[0])
            return made

        setattr(segment, "_create", legacy)  # noqa: B010
        return
    from phalanx.comm.shm import segment

    make = segment.create

    def create(nbytes: int, memfd: bool) -> Any:
        made = make(nbytes, memfd and mode != "named")
        park(made.name)  # a memfd's label: a file of that name must never appear
        return made

    setattr(segment, "create", create)  # noqa: B010


def _rank(rank: int, world_size: int, store: str, mode: str, created: Any, note: str) -> None:
    import torch.distributed as dist

    import phalanx  # noqa: F401  (registers backend "shm")

    if rank == 0:
        _hook(mode, created, note)
    dist.init_process_group("shm", init_method=f"file://{store}", rank=rank, world_size=world_size)


def _try(ctx: Any, world_size: int, mode: str, deadline_s: float) -> tuple[int, int, bool]:
    """One try: (its rank 0's segment left in /dev/shm: 0 or 1, other new phalanx-shm files
    seen meanwhile (another job's), whether the window was reached)."""
    before = _leftovers()
    with tempfile.TemporaryDirectory() as tmp:
        created = ctx.Event()
        store, note = os.path.join(tmp, "store"), os.path.join(tmp, "created")
        procs = [
            ctx.Process(target=_rank, args=(r, world_size, store, mode, created, note), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        reached = created.wait(deadline_s)
        for p in procs:
            if p.pid is not None:
                os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.join(30)
        made = Path(note).read_text() if os.path.exists(note) else ""
    left = _leftovers() - before
    ours = made in left
    if ours:  # removed so that the next try starts clean (others' files are kept)
        os.unlink(os.path.join("/dev/shm", made))
    return int(ours), len(left) - ours, reached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=100)
    parser.add_argument("--world-size", type=int, default=2)
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--named", action="store_true", help="the /dev/shm file fallback")
    kind.add_argument("--legacy", action="store_true", help="the code before issue 34")
    args = parser.parse_args()
    mode = "legacy" if args.legacy else "named" if args.named else "memfd"
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "phalanx"])
    leaked = foreign = reached = 0
    start = time.monotonic()
    for i in range(1, args.tries + 1):
        n, others, hit = _try(ctx, args.world_size, mode, deadline_s=60)
        leaked, foreign, reached = leaked + n, foreign + others, reached + hit
        if i % 10 == 0:
            print(f"{i} tries: window reached {reached}, segments left in /dev/shm {leaked}")
    result = {
        "mode": mode,
        "world_size": args.world_size,
        "tries": args.tries,
        "window_reached": reached,
        "segments_left": leaked,
        "other_jobs_files_seen": foreign,
        "seconds": round(time.monotonic() - start, 1),
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
