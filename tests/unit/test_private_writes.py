"""No module of ``phalanx.train`` writes another object's private fields (``obj._x = ...``).

The parts of a job share state through declared records (``TrainState``) and protocols
(``Runner``, ``Role``, ``SavePolicy``); a helper that sets ``job._resumed`` couples itself to the
job's insides. Writes into torch's own objects that torch reads by convention are listed
with their reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[2] / "src" / "phalanx" / "train"

TORCH_CONVENTIONS = {
    ("loop_helpers.py", "_opt_called"): "torch's scheduler warns on step() before this is set",
    ("loop_helpers.py", "_wrapped_by_lr_sched"): "torch's scheduler marks a wrapped step",
    ("comm_timing.py", "_sync_params"): "ZeroRedundancyOptimizer's own hook, timed",
}


def _private_writes(path: Path) -> list[tuple[str, int]]:
    """(attribute, line) of every ``x._attr = ...`` / ``x._attr += ...`` where x is not self."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            for t in ast.walk(target):
                private = isinstance(t, ast.Attribute) and t.attr.startswith("_")
                if not private or t.attr.endswith("__"):  # dunders (__annotations__) are public
                    continue
                assert isinstance(t, ast.Attribute)
                owner = t.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue
                found.append((t.attr, t.lineno))
    return found


def test_the_walker_sees_a_private_write(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("def f(job):\n    job._resumed = True\n    self._ok = 1\n    job._x += 1\n")
    assert _private_writes(sample) == [("_resumed", 2), ("_x", 4)]


def test_train_modules_write_no_other_objects_private_fields() -> None:
    wrong = []
    for path in sorted(TRAIN.rglob("*.py")):
        for attr, line in _private_writes(path):
            if (path.name, attr) not in TORCH_CONVENTIONS:
                wrong.append(f"{path.relative_to(TRAIN)}:{line}: ._{attr.lstrip('_')} = ...")
    assert not wrong, "writes into another object's private fields:\n" + "\n".join(wrong)
