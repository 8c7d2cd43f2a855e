"""``train/`` does not probe the objects it is given: no ``getattr`` / ``hasattr`` on models,
optimizers or samplers. A strategy declares what it does (``train/strategies/base.py``), the job
calls that. The few ``getattr`` calls left are on torch itself, each with its reason here."""

from __future__ import annotations

import ast
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[2] / "src" / "phalanx" / "train"
PROBES = {"getattr", "hasattr"}

ALLOWED = {
    ("comm_timing.py", "optimizer", "_sync_params"): (
        "torch's ZeroRedundancyOptimizer has no public hook around its parameter broadcast; "
        "where a torch version lacks this private method the wait is reported not measured"
    ),
    ("straggler_monitor.py", "dist", "all_gather_single"): (
        "torch.distributed's own API across versions: torch 2.13 renamed all_gather_into_tensor"
    ),
    ("straggler_monitor.py", "pg", "_device_types"): (
        "torch's default ProcessGroup: its backends' collective timeout is only reachable there"
    ),
}
"""(file under train/, object, attribute) -> why this probe is allowed."""


def _probes() -> list[tuple[str, str, str, int]]:
    found = []
    for path in sorted(TRAIN.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id in PROBES and len(node.args) >= 2:
                obj, attr = node.args[0], node.args[1]
                name = attr.value if isinstance(attr, ast.Constant) else ast.unparse(attr)
                rel = str(path.relative_to(TRAIN))
                found.append((rel, ast.unparse(obj), str(name), node.lineno))
    return found


def test_train_probes_only_torch_on_the_allow_list() -> None:
    unexpected = [p for p in _probes() if p[:3] not in ALLOWED]
    assert not unexpected, "probing in train/ (file, object, attribute, line): " + repr(unexpected)


def test_every_allow_list_entry_is_still_needed_and_says_why() -> None:
    seen = {p[:3] for p in _probes()}
    assert set(ALLOWED) <= seen, f"stale allow-list entries: {set(ALLOWED) - seen}"
    assert all(len(reason) > 40 for reason in ALLOWED.values())


def test_the_scan_sees_a_probe(tmp_path: Path) -> None:
    global TRAIN
    (tmp_path / "x.py").write_text("def f(m):\n    return hasattr(m, 'pipelined')\n")
    saved, TRAIN = TRAIN, tmp_path
    try:
        assert _probes() == [("x.py", "m", "pipelined", 2)]
    finally:
        TRAIN = saved
