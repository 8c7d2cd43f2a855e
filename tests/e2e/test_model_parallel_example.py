"""examples/model_parallel_resnet.py (seed 001 §4) runs, learns, and writes a profiler trace."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_model_parallel_resnet_example_trains_and_profiles(tmp_path: Path) -> None:
    script = ROOT / "examples" / "model_parallel_resnet.py"
    cmd = [sys.executable, str(script), "--profile", "--trace-dir", str(tmp_path / "trace")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    second = "cuda:1" if torch.cuda.device_count() >= 2 else "cpu"
    assert f"part 1 on {second}: layers" in out, out
    found = re.search(r"first 5 steps ([0-9.]+), of the last 5 steps ([0-9.]+)", out)
    assert found, out
    first, last = map(float, found.groups())
    assert last < first / 2, out  # digits are easy: the loss falls well within 30 steps
    assert list((tmp_path / "trace").glob("*.pt.trace.json")), out
