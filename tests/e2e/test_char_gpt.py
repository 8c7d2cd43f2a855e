"""examples/char_gpt.py trains a char-level GPT on Shakespeare with 2 DDP ranks (`phalanx run`)."""

from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path

import pytest

from tests.e2e.launching import standalone

ROOT = Path(__file__).resolve().parents[2]


def test_char_gpt_val_loss_falls_under_phalanx_run() -> None:
    script = str(ROOT / "examples" / "char_gpt.py")
    cmd = [
        *standalone(2),
        script,
        "--steps",
        "20",
        "--eval-every",
        "10",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    vals = [float(v) for v in re.findall(r"\[rank 0\] step \d+: train \S+ val (\S+)", proc.stdout)]
    assert len(vals) == 3, proc.stdout  # steps 0, 10, 20
    assert vals[-1] < vals[0]
    assert vals[-1] < math.log(65) - 1.0, proc.stdout  # ln(65) = 4.17 is a uniform guess
    assert "[rank 1] step" not in proc.stdout  # only rank 0 prints
    assert "[rank 0] sample:" in proc.stdout


@pytest.mark.parametrize(
    "split",
    [pytest.param(["--pp", "2"], marks=pytest.mark.extended), ["--tp", "2"]],
    ids=["dp2xpp2", "dp2xtp2"],
)
def test_char_gpt_trains_split_over_four_ranks(split: list[str]) -> None:
    script = str(ROOT / "examples" / "char_gpt.py")
    cmd = [
        *standalone(4),
        script,
        "--steps",
        "30",
        "--eval-every",
        "30",
        "--eval-batches",
        "2",
        "--batch-size",
        "8",
        *split,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"(pp {2 if split[0] == '--pp' else 1} x tp {2 if split[0] == '--tp' else 1})" in (
        proc.stdout
    )
    assert "GPT 818,176 parameters" in proc.stdout  # the whole model's count, before the split
    vals = [float(v) for v in re.findall(r"\[rank 0\] step \d+: train \S+ val (\S+)", proc.stdout)]
    assert len(vals) == 2, proc.stdout  # steps 0 and 30
    assert vals[-1] < math.log(65) - 1.0, proc.stdout
