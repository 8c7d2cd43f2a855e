"""Live recovery end to end: 4 ranks, rank 2 SIGKILLed mid-loop, 3 continue, a replacement joins.

The parent hosts the store (see ``live_cases.py``); every worker checks the all-reduce sum of
every step against the current membership, so a wrong or split group fails the test.
"""

from __future__ import annotations

import signal
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


def _start(job: LiveJob, deadline: float) -> dict[str, int]:
    for rank in range(job.world_size):
        job.start(rank)
    job.wait_for("steady", job.world_size, deadline)
    return {m: p.pid for m, p in job.procs.items()}


def _finish(job: LiveJob, members: list[str], deadline: float) -> dict[str, tuple[object, ...]]:
    """Stop the loop; every member's final event, after checking its sums and state."""
    job.stop()
    done = {e[1]: e for e in job.wait_for("done", len(members), deadline)}
    assert sorted(done) == sorted(members), done
    for member, event in done.items():
        wrong = [(step, ws) for step, ws, ok in event[3] if not ok]
        assert not wrong, f"member {member}: wrong sums at (step, world size) {wrong}"
    assert len({e[4] for e in done.values()}) == 1, "the members' final states differ"
    return done


@pytest.mark.timeout(120)
def test_two_concurrent_kills_leave_two_ranks() -> None:
    job = LiveJob(4, run_options())
    deadline = time.monotonic() + 90
    try:
        pids = _start(job, deadline)
        job.kill("0.1")
        job.kill("0.2")
        recovered = job.wait_for("recovered", 2, deadline)
        assert {e[1]: e[3] for e in recovered} == {"0.0": 2, "0.3": 2}, recovered
        job.wait_for("steady", 2, deadline)
        done = _finish(job, ["0.0", "0.3"], deadline)
    finally:
        job.close()
    assert all(done[m][2] == pids[m] for m in done)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("gap_s", [0.0, 0.02, 0.05])
def test_a_second_failure_during_recovery(gap_s: float) -> None:
    """Rank 3 dies ``gap_s`` after rank 2, while the survivors agree or build the new group."""
    job = LiveJob(4, run_options())
    deadline = time.monotonic() + 90
    try:
        _start(job, deadline)
        job.kill("0.2")
        time.sleep(gap_s)
        job.kill("0.3")
        job.wait_for("recovered", 2, deadline)
        job.wait_for("steady", 2, deadline)
        _finish(job, ["0.0", "0.1"], deadline)
    finally:
        job.close()


@pytest.mark.timeout(120)
def test_replacement_arriving_during_recovery_joins() -> None:
    job = LiveJob(3, run_options())
    deadline = time.monotonic() + 90
    try:
        _start(job, deadline)
        job.kill("0.1")
        job.start(1, incarnation=1)  # before the survivors have recovered
        admitted = job.wait_for("admitted", 3, deadline)
        assert {e[2] for e in admitted} == {3} and len({e[3] for e in admitted}) == 1, admitted
        job.wait_for("steady", 3, deadline)
        _finish(job, ["0.0", "0.1", "0.2"], deadline)
    finally:
        job.close()


@pytest.mark.timeout(120)
def test_unreported_death_is_found_by_heartbeat() -> None:
    """No death record from the launcher: the survivors wait for the heartbeat to go stale."""
    job = LiveJob(3, run_options(heartbeat_interval=0.2, heartbeat_timeout=1.5))
    deadline = time.monotonic() + 90
    try:
        _start(job, deadline)
        t_kill = job.kill("0.2", report=False)
        recovered = job.wait_for("recovered", 2, deadline)
        waited = max(e[2] for e in recovered) - t_kill
        assert 1.0 < waited < 10.0, f"recovered {waited:.2f} s after the kill"
        _finish(job, ["0.0", "0.1"], deadline)
    finally:
        job.close()


@pytest.mark.timeout(120)
def test_hung_member_is_excluded_and_told_so() -> None:
    """SIGSTOP: collectives time out, the heartbeat goes stale; once resumed it is Excluded."""
    job = LiveJob(3, run_options(timeout=3.0, heartbeat_interval=0.2, heartbeat_timeout=1.5))
    deadline = time.monotonic() + 90
    try:
        _start(job, deadline)
        job.signal("0.1", signal.SIGSTOP)
        recovered = job.wait_for("recovered", 2, deadline)
        assert {e[1]: e[3] for e in recovered} == {"0.0": 2, "0.2": 2}, recovered
        job.signal("0.1", signal.SIGCONT)
        error = job.wait_for("error", 1, deadline)[0]
        assert error[1] == "0.1" and "Excluded" in str(error[2]), error
        assert "declared dead" in str(error[2]), error
        _finish(job, ["0.0", "0.2"], deadline)
    finally:
        job.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("gap_s", [0.0, 0.1, 0.3])
def test_a_failure_while_a_replacement_is_admitted(gap_s: float) -> None:
    """Slot 0.1 is replaced; slot 0.2 dies ``gap_s`` after the replacement starts."""
    job = LiveJob(3, run_options())
    deadline = time.monotonic() + 90
    try:
        _start(job, deadline)
        job.kill("0.1")
        job.wait_for("recovered", 2, deadline)
        job.start(1, incarnation=1)
        time.sleep(gap_s)
        job.kill("0.2")
        while job.wait_for("admitted", 1, deadline)[0][1] != "0.1":
            pass  # 0.0's, or 0.2's when it died after a 3-rank admission
        job.wait_for("steady", 2, deadline)  # 20 checked steps of {0.0, 0.1#1}
        _finish(job, ["0.0", "0.1"], deadline)
    finally:
        job.close()
