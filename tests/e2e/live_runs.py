"""Runs of ``scripts/live_job.py`` (a ``phalanx.Job`` under ``--recovery live``), checked."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tests.e2e.launching import SCRIPTS, finish, launcher_env, start

__all__ = ["LIVE_SCRIPT", "check_records", "live_job", "run_live_job"]

LIVE_SCRIPT = str(SCRIPTS / "live_job.py")


def check_records(folder: Path, err: str) -> dict[str, dict[str, Any]]:
    """Every process's record by ``<member>.<incarnation>``, checked: never restarted, at step
    60 at world 4 at the end, a clean ledger, the tracked state right, equal replicas."""
    records = {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json")}
    for name, record in records.items():
        assert record["pid"] == record["started_pid"], name
        assert record["step"] == 60 and record["world_size"] == 4, (
            name,
            {k: v for k, v in record.items() if k != "params"},
            _log(err),
        )
        assert record["problems"] == [] and record["epochs"] == [0, 1, 2], (name, record)
        assert record["tracked_steps"] == 60, (name, record["tracked_steps"])
    assert len({r["digest"] for r in records.values()}) == 1, records  # equal replicas
    return records


def _log(err: str) -> str:
    """The launcher's output without progress bars, its last 8000 characters."""
    return "\n".join(line for line in err.splitlines() if "batch/s]" not in line)[-8000:]


def live_job(
    folder: Path,
    kills: str,
    recovery: str,
    replacements: int,
    strategy: str = "ddp",
    exchange_delay_s: float = 0.0,
    **env: str,
) -> dict[str, dict[str, Any]]:
    """Run the job on one node (4 workers); :func:`check_records` of its processes.
    ``exchange_delay_s``: delay every ZeRO mirror exchange (see the script); ``env``: more
    variables for the launcher and its workers (e.g. ``LIVE_JOB_STRANGER="1"``)."""
    delay = str(exchange_delay_s)
    code, out, err = run_live_job(
        folder, kills, recovery, replacements, strategy, LIVE_JOB_EXCHANGE_DELAY_S=delay, **env
    )
    assert code == 0, out + _log(err)
    return check_records(folder, err)


def run_live_job(
    folder: Path, kills: str, recovery: str, replacements: int, strategy: str = "ddp", **env: str
) -> tuple[int, str, str]:
    """Run the job on one node (4 workers) to its end (deadline: 300 s, scaled by the machine's
    slowness); its exit code, stdout and stderr, the records unchecked."""
    folder.mkdir()
    cmd = [
        *(sys.executable, "-m", "phalanx", "run", "--standalone", "--nproc-per-node", "4"),
        *("--recovery", "live", "--max-restarts", str(replacements)),
        *(LIVE_SCRIPT, str(folder), kills, "0.05", recovery, strategy),
    ]
    proc = start(cmd, launcher_env(**env))
    out, err = finish(proc, deadline=300)
    return proc.returncode, out, err
