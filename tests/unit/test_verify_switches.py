"""The switches ``phalanx verify`` turns on an unchanged script: another strategy
(``PHALANX_STRATEGY``), the same global batch at another world size
(``PHALANX_BATCH_REPLICAS``), and its command line's checks."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import phalanx
from phalanx.diagnostics.verify import cli
from phalanx.train.job_data import BATCH_REPLICAS_VAR, batch_for
from phalanx.train.strategies.registry import OVERRIDE_VAR, overridden, parse_strategy


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("zero3", phalanx.Zero(stage=3)),
        (" ddp ", phalanx.DDP()),
        ("Zero(stage=2)", phalanx.Zero(stage=2)),
        ("Mesh(tp=2)", phalanx.Mesh(tp=2)),
        ("Mesh(pp=2, micro_batches=4)", phalanx.Mesh(pp=2, micro_batches=4)),
    ],
)
def test_a_strategy_is_spelled_by_name_or_as_a_call(text: str, expected: object) -> None:
    assert parse_strategy(text) == expected


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("__import__('os').system('true')", "neither a strategy name"),
        ("Zero(stage=x)", "literal keyword arguments"),
        ("Zero(3)", "literal keyword arguments"),
        ("Zero(**{'stage': 3})", "literal keyword arguments"),
        ("Unknown(a=1)", "neither a strategy name"),
        ("Zero(stage=9)", "stage must be an int in 1..3"),
        ("Zero(sage=3)", "unexpected keyword argument 'sage'"),
        ("zero4", "neither a strategy name"),
    ],
)
def test_a_bad_spelling_is_refused_naming_the_variable_and_the_text(text: str, said: str) -> None:
    with pytest.raises(ValueError, match=rf"{OVERRIDE_VAR}=.*{said}") as caught:
        parse_strategy(text)
    assert repr(text.strip()) in str(caught.value)


def test_the_variable_replaces_the_scripts_strategy_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(OVERRIDE_VAR, raising=False)
    assert overridden(phalanx.DDP()) == phalanx.DDP()
    monkeypatch.setenv(OVERRIDE_VAR, "Zero(stage=1)")
    monkeypatch.setenv("RANK", "0")
    with caplog.at_level(logging.WARNING):
        assert overridden(phalanx.DDP()) == phalanx.Zero(stage=1)
    assert f"from {OVERRIDE_VAR} replaces the script's DDP(" in caplog.text


def test_the_global_batch_is_kept_at_another_number_of_replicas() -> None:
    assert batch_for(32, 4, {}) == 32  # not set: the script's batch
    assert batch_for(32, 4, {BATCH_REPLICAS_VAR: "2"}) == 16
    assert batch_for(32, 1, {BATCH_REPLICAS_VAR: "2"}) == 64
    with pytest.raises(ValueError, match=r"global batch of 30 does not split evenly over 4"):
        batch_for(15, 4, {BATCH_REPLICAS_VAR: "2"})
    with pytest.raises(ValueError, match=rf"{BATCH_REPLICAS_VAR}='two' must be a positive"):
        batch_for(15, 4, {BATCH_REPLICAS_VAR: "two"})


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--mode", "strategy"], "--mode strategy needs --strategy"),
        (["--mode", "world"], "--mode world needs --world"),
        (["--mode", "resume", "--steps", "4", "--at", "4"], "--at 4 must be in 1..3"),
        (["--mode", "strategy", "--strategy", "zero9"], "--strategy='zero9' is neither"),
        (["--mode", "resume", "--steps", "0"], "--steps 0 must be at least 1"),
        (["--mode", "resume", "--factor", "0"], "--factor 0.0 must be positive"),
    ],
)
def test_bad_arguments_exit_2_naming_them(
    argv: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    assert cli.main([*argv, str(script)]) == 2
    assert said in capsys.readouterr().err


def test_a_missing_script_and_a_full_keep_folder_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["--mode", "resume", str(tmp_path / "nope.py")]) == 2
    assert "nope.py' does not exist" in capsys.readouterr().err
    script = tmp_path / "train.py"
    script.write_text("")
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "x").write_text("")
    assert cli.main(["--mode", "resume", "--keep", str(tmp_path / "keep"), str(script)]) == 2
    assert "the folder is not empty" in capsys.readouterr().err
