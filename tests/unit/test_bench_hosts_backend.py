"""``phalanx bench hosts_backend``: its flags are checked before any namespace is made, it says
why it cannot run without root, and its summary (ratio, bytes, loss equality) is arithmetic on
the workers' reports."""

from __future__ import annotations

from typing import Any

import pytest

from phalanx import cli
from phalanx.bench import hosts_backend


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mbit", "0"], "--mbit must be a comma list of rates > 0 in Mbit/s, got '0'"),
        (["--mbit", "fast"], "--mbit must be a comma list of rates > 0 in Mbit/s, got 'fast'"),
        (["--mbit", ","], "--mbit must be a comma list of rates > 0 in Mbit/s, got ','"),
        (["--nproc", "0"], "--nproc must be >= 1, got 0"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--repeats", "0"], "--repeats must be >= 1, got 0"),
        (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    ],
)
def test_bad_flags_are_named(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        hosts_backend.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_without_namespaces_it_says_why_and_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(hosts_backend, "unavailable", lambda: "needs root to create namespaces")
    assert cli.main(["bench", "hosts_backend", "--mbit", "100"]) == 2
    assert capsys.readouterr().err == (
        "phalanx bench hosts_backend: needs root to create namespaces\n"
    )


def _report(shm_s: float, gloo_s: float, shm_loss: float = 2.0) -> dict[str, Any]:
    return {
        "world_size": 4,
        "nodes": 2,
        "params": 1000,
        "default_group": "HierarchicalProcessGroup",
        "steps": 3,
        "times_s": {"shm": [shm_s] * 3, "gloo": [gloo_s] * 3},
        # per host, per step: (tx, rx)
        "link_bytes": {"shm": [[[1e6, 1e6]] * 3] * 2, "gloo": [[[1.5e6, 1.5e6]] * 3] * 2},
        "final_loss": {"shm": shm_loss, "gloo": 2.0},
        "max_param_diff": 1e-8,
    }


def test_summary_ratios_bytes_and_loss_equality() -> None:
    row = hosts_backend.summarize([_report(0.4, 0.6), _report(0.5, 0.5)], 100.0)
    assert row["backends"]["shm"]["p50_ms"] == pytest.approx(450.0)
    assert row["backends"]["gloo"]["p50_ms"] == pytest.approx(550.0)
    assert row["ratio"] == pytest.approx(450 / 550)
    assert row["repeat_ratios"] == pytest.approx([0.4 / 0.6, 1.0])
    assert row["backends"]["shm"]["link_mb_per_step"] == pytest.approx(2.0)
    assert row["bytes_ratio"] == pytest.approx(2 / 3)
    assert row["same_loss"] and row["repeats"] == 2
    assert not hosts_backend.summarize([_report(0.4, 0.6, shm_loss=2.01)], 100.0)["same_loss"]


def test_a_job_whose_group_is_not_hierarchical_is_refused() -> None:
    flat = {**_report(0.4, 0.6), "default_group": "ShmProcessGroup"}
    with pytest.raises(RuntimeError, match="default group was ShmProcessGroup, not the hier"):
        hosts_backend.summarize([flat], 100.0)
