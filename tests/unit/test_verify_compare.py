"""``phalanx verify``'s comparison: relative differences, names, the noise bound, the verdict."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from phalanx import checkpoint
from phalanx.diagnostics.verify.compare import Run, compare, difference, named_values
from phalanx.diagnostics.verify.probe import GRAD_KEY, LOSSES, NAMES, SNAPSHOTS


def test_difference_is_relative_to_the_larger_value() -> None:
    a = torch.tensor([1.0, -4.0])
    assert difference(a, a.clone()) == 0.0
    assert difference(a, torch.tensor([1.0, -3.0])) == pytest.approx(0.25)
    assert difference(torch.zeros(3), torch.zeros(3)) == 0.0
    assert difference(a, torch.zeros(3)) == 1.0  # shapes differ
    assert difference(a, torch.tensor([1.0, math.nan])) == math.inf
    assert difference(3e-3, 2e-3) == pytest.approx(1 / 3)
    assert difference((0.9, 0.999), (0.9, 0.99)) == pytest.approx(0.009 / 0.999)
    assert difference(torch.tensor([1, 2]), torch.tensor([1, 3])) == 1.0  # integers: equal or not
    assert difference("adam", "sgd") == 1.0


def test_values_are_named_loss_model_gradients_optimizer_then_groups() -> None:
    state = {
        "model": {"w": torch.ones(2), "b": torch.zeros(1)},
        "optimizer": {
            "state": {0: {"exp_avg": torch.ones(2), GRAD_KEY: torch.ones(2)}, 1: {GRAD_KEY: 1}},
            "param_groups": [{"lr": 0.1, "params": [0, 1]}],
        },
    }
    names = list(named_values(state, ["w"], loss=2.5))
    assert names == [
        "loss",
        "model/w",
        "model/b",
        "grad/w",
        "grad/param1",  # no name known for the second parameter: its place
        "optimizer/w/exp_avg",
        "optimizer/group0/lr",
    ]


def _run(root: Path, name: str, steps: dict[int, tuple[float, float, float]]) -> Run:
    """A run whose step s has the given loss, weight and gradient, as the probe writes them:
    a losses file and one checkpoint per step."""
    directory = root / name
    (directory / SNAPSHOTS).mkdir(parents=True)
    lines = []
    for step, (loss, weight, grad) in steps.items():
        model = nn.Linear(3, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(weight)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.state[model.weight][GRAD_KEY] = torch.full((1, 3), grad)
        checkpoint.save(directory / SNAPSHOTS, step, model=model, optimizer=opt, keep_last=None)
        lines.append(json.dumps({"step": step, "loss": loss}))
    (directory / LOSSES).write_text("\n".join(lines) + "\n")
    (directory / NAMES).write_text(json.dumps(["weight"]))
    return Run.read(directory)


def test_the_first_value_past_the_bound_is_named_with_its_step(tmp_path: Path) -> None:
    ref = {1: (2.0, 1.0, 0.5), 2: (1.9, 0.9, 0.4), 3: (1.8, 0.8, 0.3)}
    twin = {1: (2.0, 1.0, 0.5 * (1 + 1e-6)), 2: (1.9, 0.9, 0.4), 3: (1.8, 0.8, 0.3)}
    drift = {1: (2.0, 1.0, 0.5 * (1 + 5e-6)), 2: (1.9, 0.9, 0.4 * 1.01), 3: (1.8, 0.8, 0.3)}
    reports, found = compare(
        _run(tmp_path, "ref", ref), _run(tmp_path, "twin", twin), [_run(tmp_path, "x", drift)], 0.0
    )
    assert found is not None
    assert (found.step, found.name) == (2, "grad/weight")
    assert found.difference == pytest.approx(0.01 / 1.01, rel=1e-3)
    assert [r.step for r in reports] == [1, 2, 3]  # every step, after the divergence too
    assert not reports[0].diverged  # 5e-6 is within 10 x the twin's 1e-6
    assert reports[0].bound == pytest.approx(1e-5, rel=0.05)
    assert reports[1].diverged


def test_within_the_bound_there_is_no_divergence_and_the_floor_holds(tmp_path: Path) -> None:
    ref = {1: (2.0, 1.0, 0.5), 2: (1.9, 0.9, 0.4)}
    near = {1: (2.0, 1.0, 0.5), 2: (1.9, 0.9 * (1 + 4e-7), 0.4)}
    twin = _run(tmp_path, "twin", ref)  # no noise at all
    reference, other = _run(tmp_path, "ref", ref), _run(tmp_path, "near", near)
    assert compare(reference, twin, [other], 1e-6)[1] is None
    found = compare(reference, twin, [other], 0.0)[1]  # a resume allows no difference
    assert found is not None and (found.step, found.name) == (2, "model/weight")


def test_a_resumes_halves_are_each_compared_on_their_own_steps(tmp_path: Path) -> None:
    ref = {s: (2.0 - s / 10, 1.0 - s / 10, 0.5) for s in (1, 2, 3, 4)}
    saved = {s: ref[s] for s in (1, 2)}
    resumed = {3: ref[3], 4: (1.6, 0.6, 0.5 * 1.5)}
    reports, found = compare(
        _run(tmp_path, "ref", ref),
        _run(tmp_path, "twin", ref),
        [_run(tmp_path, "saved", saved), _run(tmp_path, "resumed", resumed)],
        0.0,
    )
    assert found is not None and (found.step, found.name) == (4, "grad/weight")
    assert [r.step for r in reports] == [1, 2, 3, 4]


def test_a_folder_without_records_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path}.*{LOSSES} is missing"):
        Run.read(tmp_path)
