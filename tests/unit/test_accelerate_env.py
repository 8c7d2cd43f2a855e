"""Accelerate's CPU trap (issue 36): which workers get ACCELERATE_USE_CPU, and the start-up
hook's watch for ``accelerate`` (the real run: tests/e2e/test_accelerate_cpu.py)."""

from __future__ import annotations

import io
import os

import pytest

from phalanx.launch.worker_env import JobContext, Placement, worker_env
from phalanx.launch.worker_site import ACCELERATE_ENV
from phalanx.launch.worker_site.sitecustomize import ACCELERATE_NOTE, AccelerateOnCpu

TWO = Placement(rank=1, local_rank=1, world_size=2, local_world_size=2, node_rank=0, nnodes=1)
ONE = Placement(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, nnodes=1)
CPU = JobContext("h", 1, 0, 0, "r", cpu=True)
GPU = JobContext("h", 1, 0, 0, "r")


def _accelerate(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if "ACCELERATE" in k}


def test_cpu_workers_of_a_job_get_the_hooks_cue_and_nothing_else() -> None:
    assert _accelerate(worker_env({}, TWO, CPU)) == {ACCELERATE_ENV: "1"}
    assert _accelerate(worker_env({}, ONE, CPU)) == {}  # a single rank has no one to miss
    assert _accelerate(worker_env({}, TWO, GPU)) == {}  # Accelerate finds the GPUs itself


def test_the_users_choice_wins_and_without_the_hook_the_variable_is_set_at_once() -> None:
    assert _accelerate(worker_env({"ACCELERATE_USE_CPU": "0"}, TWO, CPU)) == {
        "ACCELERATE_USE_CPU": "0"
    }
    no_hook = worker_env({"PHALANX_EXIT_GUARD": "0"}, TWO, CPU)
    assert _accelerate(no_hook) == {"ACCELERATE_USE_CPU": "1"}


@pytest.mark.parametrize(("rank", "said"), [("0", ACCELERATE_NOTE), ("1", "")])
def test_the_hook_sets_it_when_accelerate_is_looked_for_and_rank_0_says_so_once(
    monkeypatch: pytest.MonkeyPatch, rank: str, said: str
) -> None:
    # Set, then deleted: monkeypatch then restores the variable's absence at the end, even
    # though the hook sets it behind monkeypatch's back (a leak failed the e2e test after this).
    monkeypatch.setenv("ACCELERATE_USE_CPU", "unset")
    monkeypatch.delenv("ACCELERATE_USE_CPU")
    monkeypatch.setenv("RANK", rank)
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    watch = AccelerateOnCpu()
    assert watch.find_spec("accelerated") is None and watch.find_spec("torch") is None
    assert "ACCELERATE_USE_CPU" not in os.environ
    assert watch.find_spec("accelerate") is None  # never finds anything itself
    assert os.environ["ACCELERATE_USE_CPU"] == "1"
    monkeypatch.setenv("ACCELERATE_USE_CPU", "0")  # the script changed it afterwards
    assert watch.find_spec("accelerate") is None
    assert os.environ["ACCELERATE_USE_CPU"] == "0" and err.getvalue() == said
