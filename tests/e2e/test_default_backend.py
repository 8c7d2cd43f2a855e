"""The default backend under ``phalanx run`` (issue 18, point 5): shared memory for CPU ranks
that share a machine, said in the launcher's start-up line; ``--backend gloo`` opts out."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.comm.env import discover_env
from phalanx.comm.group import resolve_backend, shares_one_machine
from tests.e2e.launching import run_ok, standalone

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "show_backend.py")


def _run(*flags: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PHALANX_BACKEND"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "phalanx.launch", "--standalone", "--nproc-per-node", "2"]
    return subprocess.run(
        [*command, *flags, SCRIPT], capture_output=True, text=True, timeout=90, env=env
    )


def test_cpu_ranks_on_one_machine_default_to_shm_and_gloo_opts_out() -> None:
    auto, gloo = _run(), _run("--backend", "gloo")
    assert auto.returncode == 0 and gloo.returncode == 0, auto.stderr + gloo.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] BACKEND shm SUM 2" in auto.stdout, auto.stdout
        assert f"[rank {rank}] BACKEND gloo SUM 2" in gloo.stdout, gloo.stdout
    assert "default backend shm (CPU ranks on one machine; --backend gloo opts out)" in auto.stderr
    assert ", backend gloo, --recovery restart)" in gloo.stderr


def test_backend_shm_can_be_chosen_and_the_start_up_line_says_so() -> None:
    """Issue 35, point 5: ``--backend shm`` was refused ("not one of auto, gloo, nccl, mpi")."""
    out, err = run_ok([*standalone(2), "--backend", "shm", SCRIPT])
    for rank in (0, 1):
        assert f"[rank {rank}] BACKEND shm SUM 2" in out, out
    assert ", backend shm (shared memory: every rank on this machine), --recovery" in err, err


def test_only_a_launchers_word_puts_ranks_on_one_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("LOCAL_WORLD_SIZE", "PHALANX_RUN_ID", "TORCHELASTIC_RUN_ID", "PHALANX_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not shares_one_machine(discover_env(), 2)  # RANK / WORLD_SIZE by hand: anywhere
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("PHALANX_RUN_ID", "job")
    assert shares_one_machine(discover_env(), 2)
    assert not shares_one_machine(discover_env(), 4)  # two nodes of 2
    assert resolve_backend(None, 0, one_machine=True) == "shm"
    assert resolve_backend("gloo", 0, one_machine=True) == "gloo"
    monkeypatch.setenv("PHALANX_BACKEND", "gloo")
    assert resolve_backend(None, 0, one_machine=True) == "gloo"
