"""``tools/process_cpu.py``: every process's CPU while a command runs, by kind and by test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.testing import scaled
from tests.script_module import load_script

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "process_cpu.py"

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")


def test_a_busy_child_is_counted_by_its_kind_and_the_command_exit_status_passes_through(
    tmp_path: Path,
) -> None:
    out = tmp_path / "procs.json"
    # One CPU-second, then a pause in which the sampler (every 0.3 s) sees the final count.
    burn = "import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end: pass"
    burn += "\ntime.sleep(1.5)"
    done = subprocess.run(
        [
            sys.executable,
            str(TOOL),
            str(out),
            "--",
            sys.executable,
            "-c",
            burn + "\nraise SystemExit(3)",
        ],
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert done.returncode == 3, done.stderr
    rows = json.loads(out.read_text())
    burner = [r for r in rows if "process_time" in r.get("command", "")]
    assert len(burner) == 1 and burner[0]["cpu"] - burner[0]["before"] >= 0.9, burner
    assert "python -c import time" in done.stdout  # the report's kind of that process


def test_kinds_name_launchers_scripts_and_forkserver_ranks() -> None:
    kind = load_script(TOOL, "process_cpu").kind
    python = "/venv/bin/python3"
    assert kind(f"{python} -m phalanx run --standalone x.py") == "launcher (phalanx run)"
    assert kind(f"{python} /venv/bin/phalanx run x.py") == "launcher (phalanx run)"
    assert (
        kind(f"{python} -m phalanx.launch --nnodes 2 x.py") == "launcher (phalanx.launch, torchrun)"
    )
    assert kind(f"{python} -m phalanx verify --mode resume x.py") == "phalanx verify"
    assert kind(f"{python} -u /repo/tests/e2e/scripts/live_job.py out -") == "live_job.py"
    assert kind(f"{python} -c from multiprocessing.forkserver import main").startswith(
        "python -c from multiprocessing.forkserver"
    )
    assert kind("/usr/sbin/ip netns exec h1 true") == "ip"
    assert kind("(kdamond.0)") == "(kdamond.0)"
