"""``phalanx verify`` on an unchanged ``phalanx.Job`` script, as a user runs it.

The script is plant-and-catch's (``tools/plant_and_catch/train.py``: digits, dropout, a buffer,
AdamW and an exponential LR schedule). A resume whose LR scheduler steps once more after loading is
caught at the first step after the resume, in the learning rate; ZeRO-2 against DDP with
gradient accumulation agrees within the measured noise.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.testing import scaled
from tests.e2e.launching import ROOT, launcher_env

pytest.importorskip("sklearn", reason="the script trains on scikit-learn's digits (dev extra)")

SCRIPT = ROOT / "tools" / "plant_and_catch" / "train.py"


def _verify(tmp_path: Path, *args: str) -> tuple[int, str, dict[str, object]]:
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "phalanx", "verify", *args, "--json", str(out), "--steps", "4"]
    done = subprocess.run(
        [*cmd, str(SCRIPT)],
        cwd=tmp_path,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    result = json.loads(out.read_text()) if out.exists() else {}
    return done.returncode, done.stdout + done.stderr, result


def test_a_scheduler_stepped_twice_on_resume_is_named_at_the_first_resumed_step(
    tmp_path: Path,
) -> None:
    code, said, result = _verify(
        tmp_path,
        "--mode",
        "resume",
        "--checked-env",
        "PHALANX_PLANT=scheduler_twice",
        "--plot",
        str(tmp_path / "verify.png"),
    )
    assert code == 1, said
    assert "DIVERGED at step 3: optimizer/group0/lr" in said
    divergence = result["divergence"]
    assert isinstance(divergence, dict) and divergence["name"] == "optimizer/group0/lr"
    steps = result["steps"]
    assert isinstance(steps, list) and [s["difference"] for s in steps[:2]] == [0.0, 0.0]
    assert (tmp_path / "verify.png").stat().st_size > 10_000


def test_zero2_agrees_with_ddp_under_accumulation_within_the_noise(tmp_path: Path) -> None:
    code, said, result = _verify(
        tmp_path, "--mode", "strategy", "--strategy", "zero2", "--against", "ddp"
    )
    assert code == 0, said
    assert "no divergence: every value of 5 steps within the bound" in said
    steps = result["steps"]
    assert isinstance(steps, list) and len(steps) == 5
    assert all(0 < s["bound"] < 1e-3 for s in steps), steps  # a noise was measured
