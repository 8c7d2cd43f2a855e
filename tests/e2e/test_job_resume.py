"""Exact resume: a job SIGKILLed between checkpoints and started again ends bit-identical."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "e2e" / "scripts" / "resume_job.py")


def _run(ckpt: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "phalanx", "run", "--standalone", "--nproc-per-node", "2",
           SCRIPT, str(ckpt), *extra]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def _trace(ckpt: Path) -> dict[int, tuple[float, float]]:
    trace = {}
    for line in (ckpt / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        trace[rec["step"]] = (rec["loss"], rec["noise"])  # a re-run step overwrites
    return trace


def _digest(out: str) -> str:
    return next(line.split()[-1] for line in out.splitlines() if "DIGEST" in line)


def test_sigkill_then_restart_is_bit_identical(tmp_path: Path) -> None:
    clean = _run(tmp_path / "clean")
    assert clean.returncode == 0, clean.stderr
    killed = _run(tmp_path / "killed", "--kill-epoch", "2")
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr, killed.stderr
    resumed = _run(tmp_path / "killed")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout + resumed.stderr
    assert _digest(resumed.stdout) == _digest(clean.stdout)
    assert _trace(tmp_path / "killed") == _trace(tmp_path / "clean")
