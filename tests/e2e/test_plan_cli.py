"""`python -m phalanx plan examples/char_gpt.py ... --json` in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_plan_char_gpt_json() -> None:
    cmd = [
        sys.executable,
        "-m",
        "phalanx",
        "plan",
        "examples/char_gpt.py",
        "--batch-size",
        "4",
        "--dp",
        "2",
        "--device-memory",
        "1GB",
        "--json",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    psi = doc["params"]
    assert psi > 100_000 and doc["precision"] == "fp32" and doc["dtype"] == "float32"
    assert (doc["batch_size"], doc["dp"], doc["device_memory"]) == (4, 2, 10**9)
    assert doc["activation_bytes"] > 0 and "holds for backward" in doc["activation_note"]
    rows = {r["strategy"]: r for r in doc["strategies"]}
    assert list(rows) == ["ddp", "zero1", "zero2", "zero3"]
    assert rows["ddp"]["model_states"] == 16 * psi  # fp32 Adam: 4 + 4 + 8 bytes per parameter
    assert rows["zero1"]["optimizer"] == 8 * psi / 2
    assert rows["zero3"]["total"] == 16 * psi / 2 + doc["activation_bytes"]
    rec = doc["recommendation"]
    assert (rec["strategy"], rec["needed"], rec["shortfall"]) == ("ddp", rows["ddp"]["total"], 0)


def test_a_reader_that_stops_reading_ends_it_quietly() -> None:
    """``phalanx plan ... | head -1``: no BrokenPipeError traceback, SIGPIPE's status."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "phalanx", "plan", "--params", "7.5e9", "--dp", "64"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    proc.stdout.close()  # before phalanx writes its first line: every write fails
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141, err
    assert "Traceback" not in err, err
