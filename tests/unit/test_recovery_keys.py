"""The live-recovery store keys: signed death records, as the launcher writes them."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from phalanx.comm.signed import SignedStore
from phalanx.recovery import live_signer, report_death
from phalanx.recovery.agree import Board
from phalanx.recovery.membership import Member

SECRET = b"s" * 32


def _board(store: dist.Store, secret: bytes | None = SECRET) -> Board:
    return Board(live_signer(store, secret, "nonce"), Member("0.0", 0), 10.0, 10.0)


def test_a_reported_death_is_read_by_members_and_records_only_grow() -> None:
    store = dist.HashStore()
    report_death(live_signer(store, SECRET, "nonce"), "0.2", 1)
    report_death(live_signer(store, SECRET, "nonce"), "0.2", 0)  # older: ignored
    assert _board(store).dead([Member("0.2", 1), Member("0.1", 0)]) == {"0.2": 1}
    raw = store.get("phalanx/live/dead/0.2").decode()
    assert raw.startswith("phx1 ") and raw.endswith(" 1")  # a signed frame of the JSON int 1


def test_forged_or_foreign_death_records_are_ignored() -> None:
    store = dist.HashStore()
    store.set("phalanx/live/dead/0.1", "0")  # a stranger's bare value
    report_death(live_signer(store, b"x" * 32, "nonce"), "0.2", 0)  # another job's secret
    report_death(live_signer(store, SECRET, "other-nonce"), "0.3", 0)  # another store's scope
    assert _board(store).dead([Member(f"0.{i}", 0) for i in range(4)]) == {}


def test_report_death_refuses_bad_arguments() -> None:
    live = live_signer(dist.HashStore(), None, "n")
    with pytest.raises(ValueError, match="member_id"):
        report_death(live, "", 0)
    with pytest.raises(ValueError, match="incarnation"):
        report_death(live, "0.1", -1)
    assert isinstance(live, SignedStore) and live.prefix == "phalanx/live/"
