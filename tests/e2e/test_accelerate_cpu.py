"""Accelerate's CPU trap under ``phalanx run`` (issue 36): on CPU, Accelerate ignores
WORLD_SIZE unless ACCELERATE_USE_CPU=1, so each rank would train alone with no error. The
workers' start-up hook sets it when the script imports ``accelerate`` and rank 0 says so once;
a user's own ACCELERATE_USE_CPU is left alone."""

from __future__ import annotations

import json

import pytest

from phalanx.launch.worker_site.sitecustomize import ACCELERATE_NOTE
from tests.e2e.launching import SCRIPTS, finish, launcher_env, standalone, start

pytest.importorskip("accelerate", reason="pip install accelerate (in the dev extra)")
pytestmark = pytest.mark.timeout(180)


def _seen(stdout: str) -> list[dict[str, object]]:
    """What each worker's Accelerate saw, in its launcher rank's order."""
    lines = sorted(line for line in stdout.splitlines() if "ACCELERATE {" in line)
    return [json.loads(line.split("ACCELERATE ", 1)[1]) for line in lines]


def test_accelerate_on_cpu_sees_every_rank_and_rank_0_says_why() -> None:
    script = str(SCRIPTS / "accelerate_cpu.py")
    ours = start([*standalone(2), script], launcher_env())
    # the user's own choice wins: ACCELERATE_USE_CPU=0 keeps Accelerate's single-process view
    theirs = start([*standalone(2), script], launcher_env(ACCELERATE_USE_CPU="0"))
    (out, err), (their_out, their_err) = finish(ours), finish(theirs)
    assert ours.returncode == 0 and theirs.returncode == 0, f"{out}\n{err}\n{their_err}"

    seen = _seen(out)
    assert [s["index"] for s in seen] == [0, 1], out
    assert all(s["processes"] == 2 and s["type"] == "DistributedType.MULTI_CPU" for s in seen)
    assert seen[0]["weight"] == seen[1]["weight"]  # gradients were averaged: one model
    notes = [line for line in err.splitlines() if ACCELERATE_NOTE.strip() in line]
    assert notes == ["[rank 0] " + ACCELERATE_NOTE.strip()], err

    alone = _seen(their_out)
    assert [(s["index"], s["processes"]) for s in alone] == [(0, 1), (0, 1)], their_out
    assert alone[0]["weight"] != alone[1]["weight"]  # the trap: each rank trained alone
    assert ACCELERATE_NOTE.strip() not in their_err
