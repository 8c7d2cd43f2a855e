"""The parameter server's consistency rules, without processes."""

from __future__ import annotations

import pytest
import torch

from phalanx.parameter_server import ServerCore
from phalanx.parameter_server.core import Reply, check_mode


def _core(mode: str, workers: int = 2, **kw: object) -> tuple[ServerCore, list]:
    applied: list = []
    core = ServerCore(workers, mode, lambda g, s: applied.append((g.clone(), s)), **kw)  # type: ignore[arg-type]
    return core, applied


def g(v: float) -> torch.Tensor:
    return torch.full((2,), v)


def test_sync_averages_a_whole_clock_before_answering() -> None:
    core, applied = _core("sync")
    core.push(0, 0, 0, g(1.0))
    assert core.pull(0, 1) == [] and applied == []  # worker 1 has not pushed clock 0
    core.push(1, 0, 0, g(3.0))
    assert len(applied) == 1 and torch.equal(applied[0][0], g(2.0))
    assert core.answers() == [Reply(0, 1)] and core.version == 1  # the waiting pull
    assert core.pull(1, 1) == [Reply(1, 1)]
    assert core.ledger.histogram() == {0: 2}


def test_async_applies_each_gradient_and_records_staleness() -> None:
    core, applied = _core("async", staleness_lr=True)
    assert core.pull(0, 0) == [Reply(0, 0)] and core.pull(1, 0) == [Reply(1, 0)]
    core.push(0, 0, 0, g(1.0))
    core.push(1, 0, 0, g(1.0))  # computed on version 0, applied to version 1
    assert [s for _, s in applied] == [1.0, 0.5]  # lr / (1 + staleness)
    assert core.version == 2 and core.ledger.histogram() == {0: 1, 1: 1}


def test_ssp_lets_a_worker_run_bound_clocks_ahead() -> None:
    core, applied = _core("ssp", bound=2)
    for step in range(3):  # worker 0 pushes clocks 0, 1, 2; worker 1 pushes nothing
        assert core.pull(0, step) == [Reply(0, 0)]
        core.push(0, step, 0, g(1.0))
    assert core.pull(0, 3) == []  # 3 clocks ahead of version 0: must wait
    core.push(1, 0, 0, g(1.0))  # clock 0 completes -> version 1 -> worker 0 may go on
    assert core.answers() == [Reply(0, 1)] and len(applied) == 1


def test_ssp_zero_is_sync() -> None:
    runs = []
    for mode, bound in (("sync", None), ("ssp", 0)):
        core, applied = _core(mode, bound=bound)
        events = []
        for step in range(3):
            events += core.pull(0, step) + core.pull(1, step)
            core.push(0, step, core.version, g(step + 1.0))
            events += core.pull(0, step + 1)
            core.push(1, step, core.version, g(2 * step))
            events += core.answers()
        runs.append((events, [a[0].tolist() for a in applied]))
    assert runs[0] == runs[1]


def test_leaving_worker_unblocks_the_others() -> None:
    core, applied = _core("ssp", bound=0)
    core.push(0, 0, 0, g(1.0))
    assert core.pull(0, 1) == []
    assert core.leave(1) == [Reply(0, 1)]  # clock 0 completes without the lost worker
    assert torch.equal(applied[0][0], g(1.0))


def test_duplicates_are_not_applied() -> None:
    core, applied = _core("async")
    assert core.push(0, 4, 0, g(1.0)) and not core.push(0, 4, 0, g(1.0))
    assert core.duplicates == 1 and len(applied) == 1 and core.accepted == 1


def test_budget_is_exact_with_granted_pulls() -> None:
    core, applied = _core("async", max_updates=3)
    assert core.pull(0, 0) == [Reply(0, 0)] and core.pull(1, 0) == [Reply(1, 0)]
    core.push(0, 0, 0, g(1.0))
    assert core.pull(0, 1) == [Reply(0, 1)]  # 1 accepted + 1 owed + this one = 3
    core.push(1, 0, 0, g(1.0))
    assert core.pull(1, 1) == [Reply(1, 2, stop=True)]
    core.push(0, 1, 1, g(1.0))
    assert core.pull(0, 2) == [Reply(0, 3, stop=True)] and len(applied) == 3


def test_version_from_the_future_is_refused() -> None:
    core, _ = _core("async")
    with pytest.raises(ValueError, match="pulled_version=5 is newer than the server's version 0"):
        core.push(0, 0, 5, g(1.0))


@pytest.mark.parametrize(
    ("mode", "bound", "match"),
    [
        ("fast", None, r"mode='fast' is not one of"),
        ("ssp", None, r"mode='ssp' needs a staleness bound >= 0, got bound=None"),
        ("ssp", -1, r"got bound=-1"),
        ("async", 2, r"bound=2 applies to mode='ssp' only"),
    ],
)
def test_bad_mode_and_bound(mode: str, bound: int | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_mode(mode, bound)


def test_bad_worker_and_budget() -> None:
    with pytest.raises(ValueError, match=r"max_updates must be >= 1 or None, got 0"):
        _core("async", max_updates=0)
    core, _ = _core("async")
    with pytest.raises(ValueError, match=r"worker=2 is not in \[0, 2\)"):
        core.pull(2, 0)
