"""A failed collective whose peers run on another machine (issue 35, point 7): the survivors'
error names the network link to that machine beside the other causes (``diagnostics/blame.py``)."""

from __future__ import annotations

import socket

import pytest

from phalanx.diagnostics import rank_files
from phalanx.diagnostics.blame import explain
from phalanx.diagnostics.rank_files import Peer, machine_id


def _snapshot(rank: int) -> dict[str, list[object]]:
    return {"0": [5, "all_reduce"]}


def test_a_peer_on_another_machine_may_be_cut_off() -> None:
    away = Peer(2, "mh1", 40, "/tmp/x", 1, addr="10.0.0.2")
    account = explain(0, {2: away, 3: None}, "0", 5, [], _snapshot, wait=False)
    assert account.text.startswith(
        "every rank had reached it (a peer may have died during it). rank(s) [2] run on another "
        "machine (mh1, 10.0.0.2): the network link to it may be down or partitioned. "
        "rank 2 had entered it (progress report #5)."
    ), account.text


def test_no_link_is_named_for_peers_on_this_machine_nor_beside_a_mismatch() -> None:
    here = Peer(1, socket.gethostname(), 40, "", 1, machine=machine_id())
    account = explain(0, {1: here}, "0", 5, [], _snapshot, wait=False)
    assert "network link" not in account.text
    away = Peer(2, "mh1", 40, "", 1)
    known = explain(0, {2: away}, "0", 5, [], _snapshot, wait=False, known=True)
    assert "network link" not in known.text


def test_another_machine_is_another_host_name_or_another_boot() -> None:
    me = socket.gethostname()
    boot = machine_id().split("/")[0]
    assert not Peer(1, me, 1, "", 0).elsewhere()
    assert not Peer(1, me, 1, "", 0, machine=f"{boot}/pid:[1]").elsewhere()  # a container
    assert Peer(1, me, 1, "", 0, machine="another-boot/pid:[1]").elsewhere()  # a twin VM
    assert Peer(1, "mh1", 1, "", 0).elsewhere()


def test_each_rank_publishes_the_address_it_reaches_the_master_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert rank_files._address() == "127.0.0.1"
    monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")
    assert rank_files._address() == ""
    monkeypatch.delenv("MASTER_ADDR")
    assert rank_files._address() == ""
