"""Exact resume: a job SIGKILLed between checkpoints and started again ends bit-identical."""

from __future__ import annotations

import json
import math
import random
import subprocess
from pathlib import Path

import pytest

from tests.e2e.launching import standalone

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "e2e" / "scripts" / "resume_job.py")


def _run(
    ckpt: Path, *extra: str, nproc: int = 2, restarts: int = 0
) -> subprocess.CompletedProcess[str]:
    cmd = [
        *standalone(nproc),
        "--max-restarts",
        str(restarts),
        SCRIPT,
        str(ckpt),
        *extra,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def _trace(ckpt: Path) -> dict[int, tuple[float, float]]:
    trace = {}
    for line in (ckpt / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        trace[rec["step"]] = (rec["loss"], rec["noise"])  # a re-run step overwrites
    return trace


def _digest(out: str) -> str:
    return next(line.split()[-1] for line in out.splitlines() if "DIGEST" in line)


@pytest.fixture(scope="module")
def clean_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """The uninterrupted 2-rank run both 2-rank tests compare with: its output, its directory."""
    ckpt = tmp_path_factory.mktemp("resume") / "clean"
    clean = _run(ckpt)
    assert clean.returncode == 0, clean.stderr
    return clean.stdout, ckpt


def test_sigkill_then_restart_is_bit_identical(
    tmp_path: Path, clean_two_ranks: tuple[str, Path]
) -> None:
    clean_out, clean_dir = clean_two_ranks
    killed = _run(tmp_path / "killed", "--kill-epoch", "2")
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr, killed.stderr
    resumed = _run(tmp_path / "killed")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout + resumed.stderr
    assert _digest(resumed.stdout) == _digest(clean_out)
    assert _trace(tmp_path / "killed") == _trace(clean_dir)


def _digest_and_first_step(out: str) -> tuple[str, float]:
    first = next(line for line in out.splitlines() if "FIRST_STEP" in line)
    return _digest(out), float(first.split("FIRST_STEP ")[1].split()[0])


@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_max_restarts_resumes_by_itself_bit_identical(
    tmp_path: Path, nproc: int, request: pytest.FixtureRequest
) -> None:
    # Rank 1 is SIGKILLed at a (seeded) random step; `--max-restarts 1` restarts everyone and
    # the job resumes from its newest checkpoint without being asked.
    step = random.Random(nproc).randrange(1, 4 * math.ceil(math.ceil(200 / nproc / 16) / 2))
    if nproc == 2:  # the same uninterrupted run as the test above: run once
        clean_out = request.getfixturevalue("clean_two_ranks")[0]
    else:
        clean = _run(tmp_path / "clean", nproc=nproc)
        assert clean.returncode == 0, clean.stderr
        clean_out = clean.stdout
    stamp = tmp_path / "stamp"
    killed = _run(
        tmp_path / "killed",
        "--kill-step",
        str(step),
        "--stamp",
        str(stamp),
        nproc=nproc,
        restarts=1,
    )
    assert killed.returncode == 0, killed.stderr
    assert "restarting all workers (restart 1 of 1" in killed.stderr
    digest, first_step = _digest_and_first_step(killed.stdout)
    assert digest == _digest(clean_out)
    assert first_step > float(stamp.read_text())  # the restart happened after the kill
