"""Live recovery end to end: 4 ranks, rank 2 SIGKILLed mid-loop, 3 continue, a replacement joins.

The parent hosts the store (see ``live_cases.py``); every worker checks the all-reduce sum of
every step against the current membership, so a wrong or split group fails the test.
"""

from __future__ import annotations

import time

import pytest

from tests.distributed.live_cases import LiveJob, run_options

DEADLINE_S = 120.0


def _kill_recover_replace() -> None:
    job = LiveJob(4, run_options())
    deadline = time.monotonic() + DEADLINE_S
    try:
        for rank in range(4):
            job.start(rank)
        job.wait_for("steady", 4, deadline)  # 20 checked steps at 4 ranks on every member
        pids = {m: p.pid for m, p in job.procs.items()}
        t_kill = job.kill("0.2")  # a tight all-reduce loop: rank 2 is almost always inside one
        recovered = job.wait_for("recovered", 3, deadline)
        latency = max(e[2] for e in recovered) - t_kill
        print(f"kill -> first checked step at world size 3: {latency:.3f} s")
        assert sorted(e[1] for e in recovered) == ["0.0", "0.1", "0.3"]
        assert all(e[3] == 3 for e in recovered), recovered
        assert all(e[4] == pids[e[1]] for e in recovered), "a survivor's process changed"
        assert latency < 5.0, f"recovery took {latency:.3f} s (generous bound: 5 s)"
        job.wait_for("steady", 3, deadline)  # 20 checked steps at world size 3
        job.start(2, incarnation=1)
        admitted = job.wait_for("admitted", 4, deadline)
        assert {e[2] for e in admitted} == {4}, admitted
        assert len({e[3] for e in admitted}) == 1, f"state differs after the transfer: {admitted}"
        job.wait_for("steady", 4, deadline)
        job.stop()
        done = job.wait_for("done", 4, deadline)
    finally:
        job.close()
    by_member = {e[1]: e for e in done}
    for member in ("0.0", "0.1", "0.3"):
        assert by_member[member][2] == pids[member], f"member {member} was restarted"
        sizes = [ws for _, ws, _ in by_member[member][3]]
        assert sizes[0] == 4 and 3 in sizes and sizes[-1] == 4, sizes
    for member, event in by_member.items():
        wrong = [(step, ws) for step, ws, ok in event[3] if not ok]
        assert not wrong, f"member {member}: wrong all-reduce sums at (step, world size) {wrong}"
    assert len({e[4] for e in done}) == 1, "the members' final states differ"


@pytest.mark.timeout(180)
def test_kill_rank_2_survivors_continue_and_replacement_joins() -> None:
    _kill_recover_replace()
