"""Live recovery with the training loops users write, through the real launcher.

``scripts/live_loop_shapes.py`` (4-rank DDP, 2 epochs of 30 steps, rank 2 SIGKILLed before
step 15, ``--max-restarts 1``) with its loader made again inside the epoch loop, and with a plain
``for x, y in loader`` instead of ``job.progress(loader)``. Checked: the launcher exits 0 by
itself within 60 s, every survivor trains both epochs to step 60 in its own process with a clean
ledger, and the parameters equal the fault-free run's (within 1e-4 of the largest magnitude with
``recovery="live"``, whose mean is reassociated at 3 members; bit-identical with "live-exact").
A replacement that arrives after the others finished exits 0; a live loader with DataLoader
workers fails at once, naming the fix, and the launcher does not hang.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.launching import SCRIPTS, finish, launcher_env, standalone, start

pytestmark = pytest.mark.timeout(300)

SCRIPT = str(SCRIPTS / "live_loop_shapes.py")
SURVIVORS = {"0.0.0", "0.1.0", "0.3.0"}


def run(
    folder: Path, loop: str, loader: str, kills: str, recovery: str, mode: str = "", nproc: int = 4
) -> tuple[int, str, dict[str, dict[str, Any]]]:
    """Run the script under ``--recovery live --max-restarts 1`` (the launcher killed with its
    workers past 60 s); its exit code, its output and every process's record by name."""
    folder.mkdir()
    cmd = [
        *standalone(nproc),
        *("--recovery", "live", "--max-restarts", "1"),
        *(SCRIPT, str(folder), loop, loader, kills, recovery, mode),
    ]
    proc = start(cmd, launcher_env())
    out, err = finish(proc, deadline=60)
    records = {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json")}
    return proc.returncode, _log(out + err), records


def _log(text: str) -> str:
    """The launcher's output without progress bars, its last 8000 characters."""
    return "\n".join(line for line in text.splitlines() if "batch/s]" not in line)[-8000:]


def check_trained(records: dict[str, dict[str, Any]], log: str) -> None:
    """Every process ran both epochs to step 60 in its first process, each sample once."""
    assert set(records) >= SURVIVORS, (sorted(records), log)
    for name, r in records.items():
        summary = {k: v for k, v in r.items() if k != "params"}
        assert r["pid"] == r["started_pid"], (name, summary)
        assert r["step"] == 60 and r["world_size"] in (3, 4), (name, summary, log)
        assert r["problems"] == [] and r["ledger_epochs"] == [0, 1], (name, summary)
        if name in SURVIVORS:  # it trained the steps itself (but one it received per change)
            assert r["epochs"] == [0, 1], (name, summary, log)
            assert r["stepped"] >= 60 - len(r["regroups"]), (name, summary)
        else:  # a replacement trained the epochs from the one it joined in
            assert r["epochs"] in ([0, 1], [1]), (name, summary, log)
    assert len({r["digest"] for r in records.values()}) == 1  # equal replicas


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The fault-free run's record (exact reduction; the loop's shape changes nothing)."""
    folder = tmp_path_factory.mktemp("shapes") / "fault-free"
    code, log, records = run(folder, "progress", "once", "-", "live-exact")
    assert code == 0, log
    assert set(records) == SURVIVORS | {"0.2.0"}
    assert all(r["regroups"] == [] and r["stepped"] == 60 for r in records.values()), log
    return records["0.0.0"]


def test_a_loader_made_each_epoch_trains_both_epochs_and_a_late_replacement_exits_0(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    code, log, records = run(tmp_path / "run", "progress", "inside", "2@15", "live", "late")
    assert code == 0, log
    assert set(records) == SURVIVORS, (sorted(records), log)
    check_trained(records, log)
    # The replacement came after the others finished (none closed its job): the launcher's
    # finish marker told it so, it exited 0, and the launcher counted its slot as finished.
    assert (tmp_path / "run" / "0.2.1.arrived").exists(), log
    assert "member 0.2#1 arrived after the job's members finished training" in log, log
    assert "job finished: 4 of 4 workers ran to the end (exit 0)" in log, log
    ours, theirs = records["0.0.0"]["params"], reference["params"]
    drift = max(abs(a - b) for a, b in zip(ours, theirs, strict=True))
    assert drift <= 1e-4 * max(map(abs, theirs)), drift


def test_a_plain_loop_over_the_loader_recovers_bit_identically(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    # The replacement starts its Job once epoch 1 has begun: it joins in epoch 1.
    code, log, records = run(tmp_path / "run", "plain", "inside", "2@15", "live-exact", "epoch1")
    assert code == 0, log
    check_trained(records, log)
    assert set(records) == SURVIVORS | {"0.2.1"}, (sorted(records), log)
    assert records["0.2.1"]["epochs"] == [1], log  # its Job.epochs() began at the one received
    regroups = records["0.0.0"]["regroups"]
    assert [r[:2] for r in regroups] == [["lost", 3], ["joined", 4]] and regroups[1][2] > 30, log
    # No collective paired wrongly after the admission (that waits out gloo's 30 s timeout).
    slowest = max(s for r in records.values() for s in r["regroup_seconds"])
    assert slowest < 20, {name: r["regroup_seconds"] for name, r in records.items()}
    assert records["0.0.0"]["digest"] == reference["digest"], log


def test_a_live_loader_with_workers_fails_at_once_naming_the_fix(tmp_path: Path) -> None:
    code, log, records = run(tmp_path / "run", "plain", "once", "-", "live", "workers", nproc=2)
    assert code != 0 and records == {}, log
    assert "make the loader with num_workers=0" in log, log
    # The replacement of the first worker to fail found nobody left to admit it: it exited
    # instead of waiting out its join timeout, and so did the launcher.
    assert "cannot join: every member of generation 0" in log, log
