"""``phalanx diagnose --ledger``: a live job's sample ledger audited from a file or checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from phalanx.cli import main as phalanx_cli
from phalanx.data.elastic_sampler import ElasticSampler
from phalanx.data.ledger import SampleLedger


def main(argv: list[str]) -> int:
    """``phalanx diagnose ARGV``, as the command line runs it."""
    return phalanx_cli(["diagnose", *argv])


def _ledger(repeat: bool) -> SampleLedger:
    sampler = ElasticSampler(range(12), 4, 2, 0, shuffle=True, seed=5)
    ledger = SampleLedger.for_sampler(sampler)
    for plan in list(sampler.plans()):
        for rank in range(2):
            ids = sampler.indices(plan, rank)
            ledger.record(
                plan.step, plan.epoch, rank, ids + ids[:1] if repeat and plan.step == 1 else ids
            )
        sampler.commit(plan)
    return ledger


def test_a_clean_ledger_passes_and_a_repeated_sample_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    clean, bad = tmp_path / "clean.json", tmp_path / "bad.json"
    clean.write_text(json.dumps(_ledger(False).to_dict()))
    bad.write_text(json.dumps(_ledger(True).to_dict()))
    assert main(["--ledger", str(clean)]) == 0
    assert "epoch 0: 12 samples trained: every sample exactly once" in capsys.readouterr().out
    assert main(["--ledger", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "epoch 0: 14 samples trained: 1 problem(s)" in out, out
    assert "at (step, rank) [(1, 1), (1, 1)]" in out and "trained more than once" in out, out


def test_a_folder_without_a_live_checkpoint_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--ledger", str(tmp_path)]) == 2
    assert "no committed checkpoint" in capsys.readouterr().err
