"""The progress thread never ends silently: a bug is logged and it goes on; a lost store is said."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch.distributed as dist

from phalanx.comm.signed import SignedStore
from phalanx.diagnostics import tracking


class _Watch:
    def __init__(self) -> None:
        self.ticks = 0

    def tick(self, store: SignedStore) -> None:
        self.ticks += 1
        if self.ticks == 1:
            raise ValueError("an unexpected value in the hang protocol")


class _GoneStore:
    def set(self, key: str, value: str) -> None:
        raise dist.DistNetworkError("Connection was likely closed")


def _run(t: tracking._Tracker, store: SignedStore, until: float) -> threading.Thread:
    thread = threading.Thread(target=tracking._publisher, args=(t, store), daemon=True)
    thread.start()
    deadline = time.monotonic() + until
    while thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    return thread


def test_a_bug_is_logged_once_and_the_thread_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(tracking, "PUBLISH_INTERVAL_S", 0.01)
    store = SignedStore(dist.HashStore(), None, "s")
    t = tracking._Tracker(store, 0, 2, False, 5.0)
    watch = _Watch()
    t.watch = watch  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING):
        thread = _run(t, store, 0.3)
        assert thread.is_alive() and watch.ticks > 3
        t.stop_event.set()
        thread.join(5)
    assert caplog.text.count("the progress thread hit an error; it goes on") == 1
    assert "an unexpected value in the hang protocol" in caplog.text
    assert store.get("progress/0") == {}


def test_a_lost_store_stops_the_thread_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(tracking, "PUBLISH_INTERVAL_S", 0.01)
    monkeypatch.setattr(tracking, "STORE_LOST_S", 0.1)
    store = SignedStore(_GoneStore(), None, "s")  # type: ignore[arg-type]
    t = tracking._Tracker(store, 3, 2, False, 5.0)
    with caplog.at_level(logging.WARNING):
        thread = _run(t, store, 5.0)
    assert not thread.is_alive()
    assert "rank 3: the rendezvous store has not answered" in caplog.text
    assert "live hang reports are off from now on" in caplog.text
