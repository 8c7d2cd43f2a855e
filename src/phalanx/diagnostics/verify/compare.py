"""Comparing two verified runs step by step: the noise bound and the first divergence.

A run (:mod:`.probe`) left, per step ``s``, the mean loss and a snapshot taken just
before the optimizer applied step ``s``: the parameters and buffers it had, the gradients it
was about to apply and the optimizer state (and param groups: the learning rate...). Every
value is given a name:

- ``loss``;
- ``model/<name>``: a parameter or buffer, as the model's ``state_dict`` names it;
- ``grad/<param>``: the gradient of a parameter;
- ``optimizer/<param>/<key>``: an optimizer state entry (``exp_avg``, ``momentum_buffer``...);
- ``optimizer/group<i>/<key>``: a param-group setting (``lr``, ``betas``...).

``<param>`` is the parameter's name where the run knew it (``param<i>`` otherwise: its place in
the optimizer). The *difference* of two values is relative: ``max|a - b| / max(max|a|, max|b|)``
(0 when both are zero; 1 when one is missing or their shapes differ).

The *noise* of a step is the largest difference between the reference run and its twin, which
differs only by the rounding of its reductions (:data:`.probe.ENV_PERTURB`), or, for a
resume, by nothing. A step's *bound* is ``FACTOR`` times the largest noise up to that step
(noise grows as training amplifies it, and does not shrink back), at least the mode's floor.
The first divergence is the first step, and in it the first value in the order above, whose
difference from the reference exceeds the bound.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from phalanx.checkpoint.catalog import committed
from phalanx.checkpoint.interop_state import read_state
from phalanx.diagnostics.verify.probe import GRAD_KEY, LOSSES, NAMES, SNAPSHOTS

__all__ = [
    "FACTOR",
    "Divergence",
    "Run",
    "StepReport",
    "compare",
    "difference",
    "named_values",
]

FACTOR = 10.0
"""How far above the measured noise a difference must be to count as a divergence."""


def difference(a: object, b: object) -> float:
    """The relative difference of two values (tensors, numbers, or anything else: 0 if equal)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape:
            return 1.0
        if a.numel() == 0:
            return 0.0
        if not (a.is_floating_point() or b.is_floating_point()):
            return 0.0 if torch.equal(a, b) else 1.0
        a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
        scale = max(float(a64.abs().max()), float(b64.abs().max()))
        if scale == 0.0:
            return 0.0
        gap = float((a64 - b64).abs().max())
        return gap / scale if math.isfinite(gap) else math.inf
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if a == b:
            return 0.0
        scale = max(abs(a), abs(b))
        return abs(a - b) / scale if math.isfinite(scale) and scale else math.inf
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return max((difference(x, y) for x, y in zip(a, b, strict=True)), default=0.0)
    return 0.0 if a == b else 1.0


def _param_name(index: int, names: list[str]) -> str:
    return names[index] if index < len(names) else f"param{index}"


def named_values(
    state: Mapping[str, Any], names: list[str], loss: float | None
) -> dict[str, object]:
    """Every value of one snapshot under its name, in the module docstring's order."""
    values: dict[str, object] = {}
    if loss is not None:
        values["loss"] = loss
    for key, value in state.get("model", {}).items():
        values[f"model/{key}"] = value
    optimizer = state.get("optimizer") or {}
    per_param: dict[int, Mapping[str, Any]] = {
        int(k): v for k, v in optimizer.get("state", {}).items()
    }
    for index in sorted(per_param):
        if GRAD_KEY in per_param[index]:
            values[f"grad/{_param_name(index, names)}"] = per_param[index][GRAD_KEY]
    for index in sorted(per_param):
        for key, value in per_param[index].items():
            if key != GRAD_KEY:
                values[f"optimizer/{_param_name(index, names)}/{key}"] = value
    for i, group in enumerate(optimizer.get("param_groups", [])):
        for key, value in group.items():
            if key != "params":
                values[f"optimizer/group{i}/{key}"] = value
    return values


@dataclass
class Run:
    """One verified run's records (``PHALANX_VERIFY_DIR``), read lazily."""

    directory: Path
    losses: dict[int, float | None] = field(default_factory=dict)
    snapshots: dict[int, Path] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)

    @classmethod
    def read(cls, directory: str | Path) -> Run:
        """The records in ``directory``; raises ``FileNotFoundError`` naming it if it has none."""
        directory = Path(directory)
        losses_file = directory / LOSSES
        if not losses_file.is_file():
            raise FileNotFoundError(
                f"{directory} holds no verified run ({LOSSES} is missing): did the script make "
                f"a phalanx.Job and step it?"
            )
        run = cls(directory)
        for line in losses_file.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                run.losses[int(record["step"])] = record["loss"]
        if (directory / SNAPSHOTS).is_dir():
            run.snapshots = dict(committed(directory / SNAPSHOTS))
        if (directory / NAMES).is_file():
            run.names = json.loads((directory / NAMES).read_text())
        return run

    def steps(self) -> list[int]:
        """The steps with a snapshot, in order."""
        return sorted(self.snapshots)

    def values(self, step: int) -> dict[str, object]:
        """Every named value of ``step``'s snapshot (and its loss)."""
        state, _ = read_state(self.snapshots[step])
        return named_values(state, self.names, self.losses.get(step))


@dataclass(frozen=True)
class StepReport:
    """One compared step: the largest difference (and its value's name), the noise, the bound."""

    step: int
    difference: float
    worst: str
    noise: float
    bound: float

    @property
    def diverged(self) -> bool:
        return self.difference > self.bound


@dataclass(frozen=True)
class Divergence:
    """The first value of the first step whose difference exceeds the bound."""

    step: int
    name: str
    difference: float
    bound: float
    reference: str
    other: str


def _largest(a: Mapping[str, object], b: Mapping[str, object]) -> Iterator[tuple[str, float]]:
    for name in list(a) + [n for n in b if n not in a]:
        if name not in a or name not in b:
            yield name, 1.0
        else:
            yield name, difference(a[name], b[name])


def _summary(value: object) -> str:
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            return f"{float(value):.9g}"
        flat = value.detach().double().flatten()
        return f"tensor{tuple(value.shape)} max|x|={float(flat.abs().max()):.6g}"
    return "missing" if value is None else repr(value)


def compare(
    reference: Run,
    twin: Run,
    others: list[Run],
    floor: float,
    factor: float = FACTOR,
) -> tuple[list[StepReport], Divergence | None]:
    """Compare each of ``others`` with ``reference`` over the steps they share, against the
    noise between ``reference`` and ``twin``; the per-step reports and the first divergence.

    ``others`` are the runs a verification checks (one, or the two halves of a resume: each
    covers its own steps). A step that ``reference`` has and no other run has is not compared.
    Every step is reported, those after the first divergence too (how it grows).
    """
    named = next((run.names for run in (reference, twin, *others) if run.names), [])
    for run in (reference, twin, *others):  # ZeRO or a Mesh rebuilds the optimizer: by place
        run.names = named
    reports: list[StepReport] = []
    found: Divergence | None = None
    envelope = 0.0
    twin_steps = set(twin.steps())
    for step in reference.steps():
        other = next((run for run in others if step in run.snapshots), None)
        if other is None:
            continue
        ref = reference.values(step)
        if step in twin_steps:
            envelope = max(
                envelope, max((d for _, d in _largest(ref, twin.values(step))), default=0.0)
            )
        bound = max(factor * envelope, floor)
        got = other.values(step)
        diffs = list(_largest(ref, got))
        worst, largest = max(diffs, key=lambda nd: nd[1], default=("", 0.0))
        reports.append(StepReport(step, largest, worst, envelope, bound))
        first = next(((n, d) for n, d in diffs if d > bound), None)
        if first is not None and found is None:
            name, gap = first
            found = Divergence(
                step, name, gap, bound, _summary(ref.get(name)), _summary(got.get(name))
            )
    return reports, found
