"""A Horovod training script (pytorch_mnist.py's shape, on 8x8 digits) under ``phalanx run``.

The script differs from a Horovod one only in its import line; it must train to at least 90 %
test accuracy on 2 ranks, with and without fp16 compression of the gradient all-reduce.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sklearn")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "horovod_digits.py"


def _run(*extra: str) -> float:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "phalanx", "run", "--standalone", "--nproc-per-node", "2",
           str(SCRIPT), *extra]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr}"
    found = re.findall(r"^\[rank 0\] test accuracy: (\d\.\d{3})$", proc.stdout, re.MULTILINE)
    assert len(found) == 1, f"no accuracy line from rank 0:\n{proc.stdout[-3000:]}"
    return float(found[0])


@pytest.mark.slow
@pytest.mark.parametrize("flags", [(), ("--fp16-allreduce",)], ids=["fp32", "fp16"])
def test_horovod_script_trains_digits_under_phalanx_run(flags: tuple[str, ...]) -> None:
    accuracy = _run(*flags)
    assert accuracy >= 0.90, f"test accuracy {accuracy:.3f} < 0.90"
