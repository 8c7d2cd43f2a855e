"""A worker of the ``phalanx run --recovery live`` tests: records itself, one slot dies once.

argv: DIR VICTIM WAIT_FOR_REPLACEMENT (``1`` or ``0``)

Every process writes ``DIR/<member>.<incarnation>.start.json`` (its pid and the live
variables) when it starts. The first process of slot VICTIM waits until every other slot has
started, then SIGKILLs itself. Every other process waits (at most 60 s) until the death marker of
VICTIM is in the worker store, read through the live contract (``phalanx.launch.live_keys``)
and, with WAIT_FOR_REPLACEMENT 1, until VICTIM's replacement has started; then it writes
``DIR/<member>.<incarnation>.end.json`` (its pid, the marker it read and when) and exits 0;
the victim writes the time of its SIGKILL in ``DIR/<member>.0.kill.json``. A VICTIM written
``~M`` is slot M watched but not killed (the test kills its whole node). No process
group is ever made: the test is about the launcher.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from live_record import publish  # this folder is on sys.path

from phalanx.comm import join
from phalanx.comm.auth import job_secret
from phalanx.comm.signed import SignedStore
from phalanx.launch import live_keys

DEADLINE_S = 60.0
LIVE = ("RANK", "WORLD_SIZE", "MASTER_PORT", *live_keys.LIVE_ENV)


def _wait_for(what: str, ready: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not ready():
        if time.monotonic() > deadline:
            sys.exit(f"{what} did not happen within {DEADLINE_S} s")
        time.sleep(0.05)


def _signer() -> SignedStore:
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = timedelta(seconds=DEADLINE_S)
    store = dist.TCPStore(addr, port, is_master=False, timeout=timeout)
    run_id, rank = os.environ["PHALANX_RUN_ID"], int(os.environ["RANK"])
    nonce = join.join_job(store, job_secret(), rank, run_id, 0, f"{addr}:{port}", timeout)
    return live_keys.live_signer(store, job_secret(), nonce)


def main() -> None:
    folder, victim, wait_replacement = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
    me = os.environ[live_keys.MEMBER_ENV]
    incarnation = int(os.environ[live_keys.INCARNATION_ENV])
    record = {"pid": os.getpid(), "env": {k: os.environ.get(k) for k in LIVE}}
    publish(folder / f"{me}.{incarnation}.start.json", record)
    nodes, local = int(os.environ["GROUP_WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    members = [live_keys.member_id(n, r) for n in range(nodes) for r in range(local)]
    watch_only, victim = victim.startswith("~"), victim.lstrip("~")
    if me == victim and incarnation == 0 and not watch_only:
        others = [folder / f"{m}.0.start.json" for m in members if m != victim]
        _wait_for("the other slots' start", lambda: all(p.exists() for p in others))
        publish(folder / f"{me}.{incarnation}.kill.json", {"at": time.time()})
        os.kill(os.getpid(), signal.SIGKILL)
    signer = _signer()
    _wait_for("the death marker", lambda: live_keys.dead_incarnation(signer, victim) is not None)
    seen = time.time()
    if wait_replacement:
        _wait_for("the replacement", (folder / f"{victim}.1.start.json").exists)
    dead = live_keys.dead_incarnation(signer, victim)
    end = {"pid": os.getpid(), "dead": dead, "seen_at": seen}
    publish(folder / f"{me}.{incarnation}.end.json", end)


if __name__ == "__main__":
    main()
