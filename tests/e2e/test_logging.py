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

from phalanx.testing import scaled

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "e2e" / "scripts" / "log_job.py")
LINE = "epoch 0 step {}: loss=1.5"


def _start(*args: str, launch: bool = False) -> subprocess.Popen[str]:
    launcher = ["-m", "phalanx", "run", "--standalone", "--nproc-per-node", "2"] if launch else []
    cmd = [sys.executable, *launcher, SCRIPT, *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _output(proc: subprocess.Popen[str]) -> str:
    try:
        out, err = proc.communicate(timeout=scaled(120))
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "DONE" in out
    return out + err


def _run(*args: str, launch: bool = False) -> str:
    return _output(_start(*args, launch=launch))


@pytest.fixture(scope="module")
def plain() -> dict[str, str]:
    """The three plain-python runs, started together (each is one process), by option."""
    procs = {flag: _start(*filter(None, [flag])) for flag in ("", "--quiet", "--basic-config")}
    try:
        return {flag: _output(proc) for flag, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()


def test_a_job_shows_its_info_lines_by_default(plain: dict[str, str]) -> None:
    out = plain[""]
    assert out.count(LINE.format(1)) == 1 and out.count(LINE.format(2)) == 1, out


def test_the_phalanx_logger_level_silences_them(plain: dict[str, str]) -> None:
    out = plain["--quiet"]
    assert LINE.format(1) not in out and LINE.format(2) not in out, out


def test_the_programs_handler_shows_each_line_once(plain: dict[str, str]) -> None:
    out = plain["--basic-config"]
    assert out.count(LINE.format(1)) == 1, out  # phalanx added no handler of its own
    assert f"APP phalanx.train.job {LINE.format(1)}" in out, out


@pytest.mark.slow
def test_under_phalanx_run_rank_0_shows_them() -> None:
    out = _run(launch=True)
    assert f"[rank 0] {LINE.format(2)}" in out, out  # step 1 may follow the bar on its line
    assert out.count(LINE.format(1)) == 1 and out.count(LINE.format(2)) == 1, out  # not rank 1
