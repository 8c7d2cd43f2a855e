"""The pictures: ``phalanx verify --plot`` and the timeline plot's scale."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.diagnostics.plot import _cap
from phalanx.diagnostics.verify.cli import Verification
from phalanx.diagnostics.verify.compare import Divergence, StepReport

pytest.importorskip("matplotlib", reason="the plots need matplotlib (bench extra)")


def test_a_set_up_step_far_above_the_rest_is_cut_off_the_scale() -> None:
    assert _cap([1000.0, 20.0, 21.0, 22.0, 20.0]) == pytest.approx(63.0)  # 3 x the median
    assert _cap([30.0, 20.0, 21.0, 22.0, 20.0]) == 30.0  # all shown
    assert _cap([1000.0, 20.0]) == 1000.0  # too few steps to call one an outlier


def test_verify_draws_every_step_and_names_the_divergence(tmp_path: Path) -> None:
    steps = [StepReport(s, 0.0 if s < 4 else 0.05, "x", 1e-7, 1e-6) for s in range(1, 8)]
    found = Divergence(4, "optimizer/group0/lr", 0.05, 1e-6, "0.002", "0.0019")
    out = tmp_path / "v.png"
    from phalanx.diagnostics.verify.plot import plot_divergence

    plot_divergence(Verification("resume", "a title", steps, found), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
