"""The step-slowdown measure of ``phalanx bench checkpoint``, and ``background.running``."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from phalanx.bench.step_slowdown import Trainer, slowdown
from phalanx.checkpoint import background


def test_slowdown_is_the_ratio_of_medians_less_one() -> None:
    assert slowdown([1.0, 2.0, 100.0], [2.2, 2.2, 3.0]) == pytest.approx(0.1)
    assert slowdown([2.0], [1.0]) == pytest.approx(-0.5)


def test_the_trainer_steps_until_the_write_is_done() -> None:
    trainer = Trainer(width=64, depth=2, batch=8)
    assert len(trainer.steps(3)) == 3 and all(t > 0 for t in trainer.steps(3))
    left = [4]

    def running() -> bool:
        left[0] -= 1
        return left[0] > 0

    assert len(trainer.steps_while(running)) == 4  # one step, then one per "still running"
    assert len(trainer.steps_while(lambda: False)) == 1


def test_running_is_true_only_while_the_write_thread_works(tmp_path: Path) -> None:
    release = threading.Event()

    def work() -> Path:
        release.wait(timeout=60)
        return tmp_path

    assert not background.running()
    background.start("a test write", work)
    try:
        assert background.running() and background.in_flight()
    finally:
        release.set()
    assert background.wait() == tmp_path
    assert not background.running() and not background.in_flight()
