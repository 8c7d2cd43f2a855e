"""``phalanx run --recovery live`` with a stranger in the store, a stopped worker, a lost slot
(issue 34), through the real launcher and ``scripts/live_job.py`` (4-rank DDP, 60 steps).

- A process without the job secret bumps the old join counter, puts junk at every join record
  and at torch's rendezvous keys of the next generations; then rank 2 is killed: its
  replacement joins and the job ends at full size (it used to run its last steps at 3 of 4, or
  lose 3 of 4 workers to ``ValueError: basic_string::_M_create`` and exit 0).
- A worker SIGSTOPs itself inside ``job.setup``, before the setup's broadcast of rank 0's model:
  its agent kills it within seconds and starts its replacement (the agent used to wait on the
  stopped process forever). The others, blocked in that broadcast, recover as from a step's
  collective: they regroup at 3, the replacement joins, and the job ends at full size with
  exit 0 (rank 0, the broadcast's root, used to fail there, and the job ended at 3 of 4).

Each case must end within twice the job's configured timeouts: a membership change within
2 x the live group's collective timeout (30 s, the default).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from phalanx.testing import scaled
from tests.e2e.live_runs import _log, check_records, live_job, run_live_job

pytestmark = pytest.mark.timeout(900)

LIVE_TIMEOUT_S = 30.0
"""The live group's collective timeout in ``scripts/live_job.py`` (LiveGroup's default)."""
START_S = 60.0
"""Start-up and 60 steps of the job on an idle machine (about 15 s measured), generously."""


def _check_regroups(run: dict[str, dict[str, object]]) -> None:
    slowest = max(s for r in run.values() for s in r["regroup_seconds"])  # type: ignore[attr-defined]
    assert slowest < 2 * LIVE_TIMEOUT_S, {n: r["regroup_seconds"] for n, r in run.items()}


def test_a_stranger_in_the_worker_store_then_a_kill_still_ends_at_full_size(
    tmp_path: Path,
) -> None:
    run = live_job(tmp_path / "run", "2@5", "live", 1, LIVE_JOB_STRANGER="1")
    assert set(run) == {"0.0.0", "0.1.0", "0.3.0", "0.2.1"}  # survivors kept, replacement in
    survivor = run["0.0.0"]["regroups"]
    assert survivor[0][:2] == ["lost", 3] and survivor[-1][:2] == ["joined", 4], survivor
    _check_regroups(run)


def test_a_worker_stopped_during_setup_is_replaced_and_the_job_ends_at_full_size(
    tmp_path: Path,
) -> None:
    started = time.monotonic()
    code, out, err = run_live_job(tmp_path / "run", "2@setup-stop", "live", 1)
    took = time.monotonic() - started
    assert "it was stopped (SIGSTOP or SIGTSTP) for" in err, _log(err)
    assert "killing it (SIGKILL) so that its slot can be replaced" in err, _log(err)
    assert code == 0, out + _log(err)
    run = check_records(tmp_path / "run", err)  # at step 60 at world 4, clean ledger
    assert set(run) == {"0.0.0", "0.1.0", "0.3.0", "0.2.1"}  # survivors kept, replacement in
    root = run["0.0.0"]["regroups"]  # lost in the setup's broadcast, then rejoined
    assert root[0][:2] == ["lost", 3] and root[-1][:2] == ["joined", 4], root
    _check_regroups(run)
    assert took < scaled(2 * LIVE_TIMEOUT_S + START_S), f"{took:.0f} s"
