"""Checkpoint sessions: closing never blocks on keys another rank deletes meanwhile."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from phalanx.checkpoint.sync import Session
from phalanx.comm.signed import SignedStore


def _sessions(size: int) -> list[Session]:
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=3))  # a blocking read of a deleted key fails after 3 s
    signed = SignedStore(store, b"s" * 64, "job/0")
    return [Session(rank, size, "tok", signed) for rank in range(size)]


def test_the_last_rank_to_close_deletes_every_key() -> None:
    sessions = _sessions(3)
    sessions[0].publish("committed", {"ok": True})
    for s in sessions:
        s.close()
    store = sessions[0].store
    assert store is not None
    keys = [f"phalanx/checkpoint/tok/{k}" for k in ("committed", "closed/0", "closed/1")]
    assert not any(store.exists([k]) for k in keys)


def test_close_while_another_rank_deletes_the_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two ranks close at once: both see every closed/<rank> key, and one deletes them before
    # the other reads them (a 4-rank job hung here for the store's whole timeout).
    first, second = _sessions(2)
    first.close()
    real_exists = SignedStore.exists

    def exists_then_deleted(self: SignedStore, keys: list[str]) -> bool:
        found = real_exists(self, keys)
        for k in keys:
            self.delete(k)  # the other rank, between this check and the read
        return found

    monkeypatch.setattr(SignedStore, "exists", exists_then_deleted)
    start = time.monotonic()
    second.close()
    assert time.monotonic() - start < 1.0
