"""A checkpoint's store waits give up early when a live job's peer is lost."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from phalanx.checkpoint.errors import CheckpointError
from phalanx.checkpoint.sync import Session, set_peer_check
from phalanx.comm.signed import SignedStore
from phalanx.recovery import PeerLost


@pytest.fixture
def session() -> Iterator[Session]:
    store = SignedStore(dist.HashStore(), b"k" * 32, "test")
    yield Session(rank=1, size=2, token="t", store=store)
    set_peer_check(None)


def test_a_lost_peer_ends_the_wait_at_the_next_check(session: Session) -> None:
    calls = []

    def check() -> None:
        calls.append(time.monotonic())
        if len(calls) == 2:
            raise PeerLost("member 0.0#0 died")

    set_peer_check(check)
    started = time.monotonic()
    with pytest.raises(PeerLost, match=r"0\.0#0 died"):
        session.wait("written/0")
    assert len(calls) == 2 and time.monotonic() - started < 5  # not the 1800 s timeout


def test_without_a_check_the_wait_runs_out_as_before(
    session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PHALANX_CHECKPOINT_TIMEOUT", "0.3")
    with pytest.raises(CheckpointError, match=r"gave up waiting for 'written/0'"):
        session.wait("written/0")


def test_an_answer_is_returned_while_the_check_passes(session: Session) -> None:
    set_peer_check(lambda: None)
    assert session.store is not None
    session.store.put("phalanx/checkpoint/t/written/0", {"ok": True, "n": 3})
    assert session.wait("written/0")["n"] == 3
