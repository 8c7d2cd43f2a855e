"""Live recovery with a stranger in the store (issue 34): what it writes decides nothing.

4 ranks run the checked all-reduce loop of ``live_cases.py``; the parent plays the launcher and,
before killing rank 2, a process without the job secret:

- **the join counter**: ``phalanx/live/joins`` bumped (one unsigned ``store.add`` used to starve
  every later replacement: rank 0 waited for a join record that never came), and junk and a
  frame signed with another secret at slot 0.2's join record: the replacement is admitted;
- **junk in the next generations' rendezvous keys** (torch's own, unsigned; reading them raised
  ``ValueError: basic_string::_M_create`` out of ``recover()`` and took the survivors down):
  at their old, guessable names, and at the real names of generation 1 (as a stranger that lists
  the store's keys could, once they appear): the generation fails to form and the next forms.
"""

from __future__ import annotations

import time

import pytest

from phalanx.recovery.keys import live_signer, pg_prefix
from tests.distributed.live_cases import LiveJob, run_options

DEADLINE_S = 120.0
OTHER_SECRET = b"x" * 32


def _start(job: LiveJob, deadline: float) -> dict[str, int]:
    for rank in range(job.world_size):
        job.start(rank)
    job.wait_for("steady", job.world_size, deadline)
    return {m: p.pid for m, p in job.procs.items()}


def _finish(job: LiveJob, deadline: float) -> dict[str, tuple[object, ...]]:
    job.stop()
    done = {e[1]: e for e in job.wait_for("done", job.world_size, deadline)}
    for member, event in done.items():
        wrong = [(step, ws) for step, ws, ok in event[3] if not ok]
        assert not wrong, f"member {member}: wrong sums at (step, world size) {wrong}"
    assert len({e[4] for e in done.values()}) == 1, "the members' final states differ"
    return done


@pytest.mark.timeout(180)
def test_a_forged_join_counter_and_join_record_do_not_keep_a_replacement_out() -> None:
    job = LiveJob(4, run_options())
    deadline = time.monotonic() + DEADLINE_S
    try:
        pids = _start(job, deadline)
        job.store.add("phalanx/live/joins", 7)  # the stranger's unsigned bump
        forged = live_signer(job.store, OTHER_SECRET, "n").encode("join/0.2", [["0.2", 9]])
        for value in ("junk", forged):  # the last one stays: a frame no member can verify
            job.store.set("phalanx/live/join/0.2", value)
        job.kill("0.2")
        job.wait_for("steady", 3, deadline)
        job.start(2, incarnation=1)
        admitted = job.wait_for("admitted", 4, deadline)
        assert {e[2] for e in admitted} == {4}, admitted
        job.wait_for("steady", 4, deadline)
        done = _finish(job, deadline)
    finally:
        job.close()
    for member in ("0.0", "0.1", "0.3"):
        assert done[member][2] == pids[member], f"member {member} was restarted"
    log = done["0.2"][3]
    assert isinstance(log, list) and log[-1][1] == 4, log


@pytest.mark.timeout(180)
def test_junk_in_the_next_generations_rendezvous_keys_fails_no_member() -> None:
    job = LiveJob(4, run_options())
    deadline = time.monotonic() + DEADLINE_S
    try:
        pids = _start(job, deadline)
        for k in range(1, 4):  # torch's key names under the old, guessable prefix
            for r in range(4):
                job.store.set(f"phalanx/live/g{k}/pg//0//cpu//0/{r}", "\xff" * 64)
        real = pg_prefix(job.live, 1)  # generation 1's real names, as listing the keys shows
        for r in range(3):
            job.store.set(f"{real}/0//cpu//0/{r}", "\xff" * 64)
        job.kill("0.2")
        recovered = job.wait_for("recovered", 3, deadline)
        assert sorted(e[1] for e in recovered) == ["0.0", "0.1", "0.3"]
        assert all(e[3] == 3 for e in recovered), recovered
        job.wait_for("steady", 3, deadline)
        job.start(2, incarnation=1)
        job.wait_for("admitted", 4, deadline)
        done = _finish(job, deadline)
    finally:
        job.close()
    for member in ("0.0", "0.1", "0.3"):
        assert done[member][2] == pids[member], f"member {member} was restarted"
