"""Under `phalanx run` the hang report of a live job shows in the launcher's output."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.e2e.launching import standalone

ROOT = Path(__file__).resolve().parents[2]


def test_launcher_output_carries_the_hang_report() -> None:
    cmd = [
        *standalone(2),
        str(ROOT / "tests" / "e2e" / "scripts" / "hang_rank1.py"),
    ]
    env = {**os.environ, "PHALANX_HANG_TIMEOUT": "1.5"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr  # the job is not killed: rank 1 wakes, it ends
    err = proc.stderr
    head = "phalanx hang report #1 (opened by rank 0): rank 0 has waited"
    assert f"[rank 0] {head}" in err and f"[rank 1] {head}" in err  # one text, on every rank
    assert "[rank 0] Rank(s) [1] never reached it." in err
    assert "in wait_for_the_report" in err
