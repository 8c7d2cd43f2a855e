"""DataLoader workers forked by a rank under `phalanx run` start, finish and leave no hang."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent / "scripts" / "loader_workers.py"


def test_forked_loader_workers_run_under_phalanx_run(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "phalanx", "run", "--standalone", "--nproc-per-node", "2"]
    env_dir = {"PHALANX_RANK_DIR": str(tmp_path)}

    out = subprocess.run(
        [*cmd, str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env_dir},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "loader workers ok" in out.stdout
    assert list(tmp_path.iterdir()) == []  # the ranks' files are gone after a clean exit
