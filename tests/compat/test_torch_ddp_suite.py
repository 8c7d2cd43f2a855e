"""The compat tier: torch's own DDP tests, run with torch's class and with phalanx's.

One subprocess runs every selected test of the wheel's suites (see ``torch_suite``) on CPU with
gloo: with torch's class, then with phalanx's those that torch's passed. Then, per test: torch's
class must pass it or skip it for want of a GPU (the baseline: what can run here); phalanx's
class must pass every test torch's passes, except the reviewed list in
``ddp_internal_only.txt``, whose entries must still fail on the torch-internal attribute they
name (so the list cannot silently go stale). Then, in the same subprocess (one start-up of the
suites, not two), each class runs the ``distributed_test`` tests it passed once more with the
default group on phalanx's ``backend="shm"``: both must pass there every test they pass on gloo.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from tests.compat.torch_suite import select

pytest.importorskip("expecttest", reason="torch's test modules need expecttest (dev extra)")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CASES = [c.id for c in select()]


def _internal_only() -> dict[str, str]:
    entries = {}
    with open(os.path.join(HERE, "ddp_internal_only.txt")) as f:
        for line in f:
            fields = line.split("#", 1)[0].split()
            if fields:
                test, attribute = fields
                entries[test] = attribute
    return entries


INTERNAL = _internal_only()


def _run(tmp: Any, *args: str) -> dict[str, dict[str, Any]]:
    report = tmp / "outcomes.json"
    cmd = [sys.executable, "-m", "tests.compat.torch_suite", "--impl", "both", *args]
    done = subprocess.run(
        [*cmd, "--json", str(report)], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results: dict[str, dict[str, Any]] = json.loads(report.read_text())
    return results


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return _run(tmp_path_factory.mktemp("compat"), "--then-shm")


@pytest.fixture(scope="module")
def on_shm(outcomes: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The ``distributed_test`` tests each class passed on gloo, run again with their default
    group on phalanx's ``backend="shm"`` (the RPC suite makes groups of its own)."""
    return {impl: outcomes[f"{impl}@shm"] for impl in ("torch", "phalanx")}


def test_the_internal_only_list_names_selected_tests() -> None:
    assert INTERNAL, "the reviewed list is empty: drop this test with the file"
    assert set(INTERNAL) <= set(CASES), sorted(set(INTERNAL) - set(CASES))


@pytest.mark.parametrize("case", CASES)
def test_torch_class(outcomes: dict[str, dict[str, Any]], case: str) -> None:
    got = outcomes["torch"][case]
    if got["status"] == "skipped":
        pytest.skip(f"torch's class skips it here: {got['detail']}")
    assert got["status"] == "passed", got["detail"]


@pytest.mark.parametrize("case", CASES)
def test_phalanx_class(outcomes: dict[str, dict[str, Any]], case: str) -> None:
    baseline = outcomes["torch"][case]
    if baseline["status"] != "passed":  # then the driver did not run phalanx's class on it
        pytest.skip(f"torch's class does not pass it here ({baseline['status']})")
    got = outcomes["phalanx"][case]
    if case in INTERNAL:
        assert got["status"] == "failed", f"{case} passes now: remove it from the list"
        assert INTERNAL[case] in got["detail"], got["detail"]
        pytest.xfail(f"needs torch's internal attribute {INTERNAL[case]}")
    assert got["status"] == "passed", got["detail"]


def test_both_classes_pass_on_shm_what_they_pass_on_gloo(
    outcomes: dict[str, dict[str, Any]], on_shm: dict[str, dict[str, Any]]
) -> None:
    for impl in ("torch", "phalanx"):
        on_gloo = [
            case
            for case, o in outcomes[impl].items()
            if o["status"] == "passed" and case.startswith("distributed_test::")
        ]
        assert len(on_gloo) >= 9, (impl, on_gloo)
        lost = {
            c: on_shm[impl][c]["detail"][-800:]
            for c in on_gloo
            if on_shm[impl][c]["status"] != "passed"
        }
        assert not lost, (impl, lost)
