"""``phalanx.testing.slowness``: deadlines stretch on a loaded machine, measured, not guessed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from phalanx import testing


def test_the_environment_fixes_the_factor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(testing.SLOWNESS_ENV, "2.5")
    assert testing.slowness() == 2.5 and testing.scaled(4) == 10
    monkeypatch.setenv(testing.SLOWNESS_ENV, "0.2")
    assert testing.slowness() == 1.0  # never shorter than the idle machine's limit
    monkeypatch.setenv(testing.SLOWNESS_ENV, "1e9")
    assert testing.slowness() == testing.MAX_SLOWNESS
    monkeypatch.setenv(testing.SLOWNESS_ENV, "fast")
    with pytest.raises(ValueError, match="PHALANX_TEST_SLOWNESS='fast' is not a number"):
        testing.slowness()


def test_busy_cpus_raise_the_measured_factor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(testing.SLOWNESS_ENV, raising=False)
    assert 1.0 <= testing.slowness(fresh=True) <= testing.MAX_SLOWNESS
    spin = "print(flush=True)\nwhile True: pass"
    burners = [
        subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True)
        for _ in range(3 * (os.cpu_count() or 1))
    ]
    try:
        for burner in burners:
            assert burner.stdout is not None
            burner.stdout.readline()  # it runs: it spins from here on
        # Three burners per CPU leave this process at most a quarter of one.
        assert testing.slowness(fresh=True) > 2.0
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


def test_the_deadline_message_names_the_factor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(testing.SLOWNESS_ENV, "2")
    with pytest.raises(testing.DistributedTestError, match=r"1 s deadline \(x2\.0 for"):
        testing.run_distributed(_sleep, world_size=1, timeout=1)


def _sleep() -> None:
    import time

    time.sleep(30)
