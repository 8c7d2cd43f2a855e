"""The Horovod peer-suite runner's pure parts, its reviewed rules file, and the shim package."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.script_module import load_script

TOOLS = Path(__file__).resolve().parents[2] / "tools" / "peer_suites"


def _runner() -> ModuleType:
    return load_script(TOOLS / "horovod_suite.py", "horovod_suite")


def test_the_reviewed_rules_file_parses_and_every_entry_has_a_reason() -> None:
    exclusions, hidden = _runner().read_rules(TOOLS / "horovod_exclusions.txt")
    assert all(name.startswith("test_") and reason for name, reason in exclusions.items())
    assert hidden == {"Muon": hidden["Muon"]} and "2-D" in hidden["Muon"]


def test_rules_lines_must_name_a_test_or_an_optimizer_and_a_reason(tmp_path: Path) -> None:
    rules = tmp_path / "rules.txt"
    rules.write_text("# comment\ntest_a: needs a GPU\n\nhide torch.optim.X: refuses 1-D\n")
    assert _runner().read_rules(rules) == ({"test_a": "needs a GPU"}, {"X": "refuses 1-D"})
    rules.write_text("test_b\n")
    with pytest.raises(ValueError, match=r"rules\.txt:1"):
        _runner().read_rules(rules)


def test_a_test_passes_only_if_it_passed_on_every_rank() -> None:
    ok, skip = {"outcome": "passed", "reason": ""}, {"outcome": "skipped", "reason": "no GPU"}
    fail = {"outcome": "failed", "reason": "call: E assert 1 == 2"}
    merged = _runner().merge(
        [{"t1": ok, "t2": skip, "t3": ok, "t4": ok}, {"t1": ok, "t2": skip, "t3": fail}], 2
    )
    assert merged["t1"]["outcome"] == "passed"
    assert merged["t2"] == {"outcome": "skipped", "reason": "no GPU"}
    t3, t4 = merged["t3"], merged["t4"]
    assert t3["outcome"] == "failed" and "rank 1: call: E assert" in t3["reason"]
    assert t4["outcome"] == "failed" and "rank(s) [1]" in t4["reason"]


def test_the_shim_makes_horovod_torch_phalanx_horovod() -> None:
    import phalanx.horovod

    sys.path.insert(0, str(TOOLS / "horovod_shim"))
    try:
        import horovod.torch as hvd  # type: ignore[import-not-found]
        from horovod.common.exceptions import HorovodInternalError  # type: ignore[import-not-found]

        assert hvd is phalanx.horovod
        assert issubclass(HorovodInternalError, RuntimeError)
    finally:
        sys.path.remove(str(TOOLS / "horovod_shim"))
        for name in [n for n in sys.modules if n == "horovod" or n.startswith("horovod.")]:
            del sys.modules[name]
