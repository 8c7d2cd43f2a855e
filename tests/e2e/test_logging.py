"""Library logging conventions: a Job's info lines show by default and obey the program's logging.

Real Jobs in subprocesses (``scripts/log_job.py`` logs two steps): by default rank 0 shows its
lines, under plain python and under ``phalanx run``; ``logging.getLogger("phalanx").setLevel(
logging.ERROR)`` silences them; with ``basicConfig`` the program's handler shows each line once.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "e2e" / "scripts" / "log_job.py")
LINE = "epoch 0 step {}: loss=1.5"


def _run(*args: str, launch: bool = False) -> str:
    launcher = ["-m", "phalanx", "run", "--standalone", "--nproc-per-node", "2"] if launch else []
    cmd = [sys.executable, *launcher, SCRIPT, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "DONE" in proc.stdout
    return proc.stdout + proc.stderr


def test_a_job_shows_its_info_lines_by_default() -> None:
    out = _run()
    assert out.count(LINE.format(1)) == 1 and out.count(LINE.format(2)) == 1, out


def test_the_phalanx_logger_level_silences_them() -> None:
    out = _run("--quiet")
    assert LINE.format(1) not in out and LINE.format(2) not in out, out


def test_the_programs_handler_shows_each_line_once() -> None:
    out = _run("--basic-config")
    assert out.count(LINE.format(1)) == 1, out  # phalanx added no handler of its own
    assert f"APP phalanx.train.job {LINE.format(1)}" in out, out


@pytest.mark.slow
def test_under_phalanx_run_rank_0_shows_them() -> None:
    out = _run(launch=True)
    assert f"[rank 0] {LINE.format(2)}" in out, out  # step 1 may follow the bar on its line
    assert out.count(LINE.format(1)) == 1 and out.count(LINE.format(2)) == 1, out  # not rank 1
