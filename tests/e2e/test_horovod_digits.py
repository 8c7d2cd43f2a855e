"""A Horovod training script (pytorch_mnist.py's shape, on 8x8 digits) under ``phalanx run``.

The script differs from a Horovod one only in its import line; it must train to at least 90 %
test accuracy on 2 ranks, with and without fp16 compression of the gradient all-reduce.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from phalanx.testing import scaled
from tests.e2e.launching import standalone

pytest.importorskip("sklearn")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "horovod_digits.py"


def _start(*extra: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    cmd = [
        *standalone(2),
        str(SCRIPT),
        *extra,
    ]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )


def _accuracy(proc: subprocess.Popen[str]) -> float:
    stdout, stderr = proc.communicate(timeout=scaled(120))
    assert proc.returncode == 0, f"exit {proc.returncode}\n{stdout[-3000:]}\n{stderr}"
    found = re.findall(r"^\[rank 0\] test accuracy: (\d\.\d{3})$", stdout, re.MULTILINE)
    assert len(found) == 1, f"no accuracy line from rank 0:\n{stdout[-3000:]}"
    return float(found[0])


@pytest.mark.slow
def test_horovod_script_trains_digits_under_phalanx_run_with_and_without_fp16() -> None:
    """The two runs side by side: each launcher starts its workers after its own start-up."""
    procs = {
        name: _start(*flags) for name, flags in (("fp32", ()), ("fp16", ("--fp16-allreduce",)))
    }
    try:
        for name, proc in procs.items():
            accuracy = _accuracy(proc)
            assert accuracy >= 0.90, f"{name}: test accuracy {accuracy:.3f} < 0.90"
    finally:
        for proc in procs.values():
            proc.kill()
