"""The phase clock: time between marks goes to the open phase, waits inside it are taken out."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from phalanx.comm import wait_clock
from phalanx.comm.work import run_blocking
from phalanx.train.phases import PhaseClock


class _Fake:
    """A clock and a wait counter the test moves by hand."""

    def __init__(self) -> None:
        self.t = self.w = 0.0


def _clock() -> tuple[PhaseClock, _Fake]:
    fake = _Fake()
    return PhaseClock(waited=lambda: fake.w, now=lambda: fake.t), fake


def test_waits_are_taken_out_of_the_phase_they_happen_in() -> None:
    clock, fake = _clock()
    clock.enter("data")
    fake.t = 1.0
    clock.enter("forward")
    fake.t, fake.w = 3.0, 0.5  # forward lasted 2 s, 0.5 s of it waiting (ZeRO-3's gather)
    clock.enter("backward")
    fake.t, fake.w = 7.0, 3.5  # backward 4 s, 3 s waiting in the all-reduce
    clock.enter("optimizer")
    fake.t = 8.0
    clock.enter(None)
    fake.t, fake.w = 20.0, 9.0  # untimed (the monitor, between jobs): neither counted
    clock.enter("data")
    assert clock.take() == [1.0, 1.5, 1.0, 1.0, 3.5]
    assert clock.take() == [0.0, 0.0, 0.0, 0.0, 0.0]
    shares = clock.shares()
    assert shares["communication_share"] == pytest.approx(3.5 / 8)
    assert shares["backward_share"] == pytest.approx(1 / 8)


def test_a_wait_longer_than_its_phase_is_capped() -> None:
    clock, fake = _clock()  # another thread's waits overlapping this phase
    clock.enter("backward")
    fake.t, fake.w = 1.0, 5.0
    clock.enter(None)
    assert clock.take() == [0.0, 0.0, 0.0, 0.0, 1.0]


def test_relabel_gives_the_open_stretch_to_another_phase() -> None:
    clock, fake = _clock()
    clock.enter("data")
    fake.t = 2.0
    clock.relabel("forward")  # no progress(): loading and forward were one stretch
    clock.enter("backward")
    assert clock.take()[:2] == [0.0, 2.0]


def test_bad_phase_names() -> None:
    clock, _ = _clock()
    with pytest.raises(ValueError, match=r"phase must be one of .* got 'comm'"):
        clock.enter("comm")
    with pytest.raises(ValueError, match="got None"):
        clock.relabel(None)  # type: ignore[arg-type]


def test_wait_clock_counts_nested_waits_once() -> None:
    wait_clock.claim()  # this thread's waits count (a Job made on another thread claims it)
    before = wait_clock.waited()
    with wait_clock.blocked(), wait_clock.blocked():  # DDP's future around a tracked work
        time.sleep(0.05)
    assert 0.05 <= wait_clock.waited() - before < 0.095  # twice would be >= 0.1
    wait_clock.add(0.25)
    assert 0.3 <= wait_clock.waited() - before < 0.345


def _wait_on_a_thread(idle: bool = False) -> float:
    before = wait_clock.waited()
    thread = threading.Thread(target=_sleep_blocked, args=(idle,))
    thread.start()
    thread.join(5)
    return wait_clock.waited() - before


def _sleep_blocked(idle: bool = False) -> None:
    with wait_clock.blocked(idle=idle):
        time.sleep(0.05)


def test_only_the_owner_thread_s_waits_count() -> None:
    assert _wait_on_a_thread() == 0.0  # a heartbeat's or a server thread's wait
    done = threading.Event()

    def owner() -> None:
        wait_clock.claim()
        done.set()

    try:
        threading.Thread(target=owner).start()
        assert done.wait(5)
        before = wait_clock.waited()
        _sleep_blocked()  # the main thread no longer owns the clock
        assert wait_clock.waited() == before
    finally:
        wait_clock.claim()  # back to this (the main) thread
    before = wait_clock.waited()
    _sleep_blocked()
    assert wait_clock.waited() - before >= 0.05


def test_idle_waits_never_count() -> None:
    before = wait_clock.waited()
    _sleep_blocked(idle=True)
    entry = SimpleNamespace(idle=True, begin=lambda: None, end=lambda: None)
    run_blocking(entry, lambda: time.sleep(0.05))  # type: ignore[arg-type]
    assert wait_clock.waited() == before
    with wait_clock.blocked(), wait_clock.blocked(idle=True):  # the outermost decides
        time.sleep(0.02)
    assert wait_clock.waited() - before >= 0.02


def _backward_with_a_wait() -> None:
    x = torch.ones(2, requires_grad=True)
    x.register_hook(lambda g: _sleep_blocked() or g)
    (2 * x).sum().backward()


def test_a_wait_inside_backward_counts_on_any_thread() -> None:
    """An accelerator's backward hooks run on autograd's device threads, not the owner."""
    before = wait_clock.waited()
    thread = threading.Thread(target=_backward_with_a_wait)
    thread.start()
    thread.join(5)
    assert wait_clock.waited() - before >= 0.05
