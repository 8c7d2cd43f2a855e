"""The shm segment's hand-over in one process: signed records, checked names and files, no leak.

Two "ranks" run as two threads of this process over one in-memory store: rank 0 makes the
segment, rank 1 opens it (a memfd through ``/proc/<pid>/fd``, or a named file).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from phalanx.comm.shm import segment_file
from phalanx.comm.shm.segment import (
    SEGMENT_KEY,
    SEGMENT_PREFIX,
    Meeting,
    check_one_host,
    open_segment,
)
from phalanx.comm.shm.segment_file import Handle, SegmentError, check_name, open_handle
from phalanx.comm.shm.sync import process_start
from phalanx.comm.signed import SignedStore

SECRET = b"s" * 64
SHORT = timedelta(seconds=1)


def _signed(store: dist.Store | None = None, secret: bytes | None = SECRET) -> SignedStore:
    return SignedStore(store or dist.HashStore(), secret, "test-scope").sub(SEGMENT_KEY)


def _meeting(rank: int, visible: bool = True, nonces: tuple[str, str] = ("a0", "b1")) -> Meeting:
    me = (os.getpid(), process_start(os.getpid()) or 0)
    return Meeting(["here", "here"], [me, me] if visible else None, list(nonces), rank)


def _pair(signed: SignedStore, visible: bool, nbytes: int = 1 << 16) -> list[Any]:
    """Rank 0 and rank 1 open one segment; each result is (path, map) or the exception."""
    out: list[Any] = [None, None]

    def rank(r: int) -> None:
        try:
            out[r] = open_segment(signed, _meeting(r, visible), nbytes, timedelta(seconds=10))
        except Exception as exc:
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


@pytest.mark.parametrize("visible", [True, False], ids=["memfd", "named"])
def test_two_ranks_share_one_segment_and_leave_nothing(visible: bool) -> None:
    (path0, seg0), (path1, seg1) = _pair(_signed(), visible)
    seg0[100:104] = b"ping"
    assert seg1[100:104] == b"ping"  # the same pages
    assert path0 == path1 and os.path.basename(path0).startswith(SEGMENT_PREFIX)
    assert not os.path.exists(path0)
    seg0.close()
    seg1.close()


def test_a_forged_or_replayed_record_is_skipped_and_named() -> None:
    signed = _signed()
    stranger = _signed(signed.store, secret=b"x" * 64)
    forged: dict[str, Any] = {"nonces": ["a0", "b1"], "error": "", "handle": None}
    handle = {"kind": "file", "name": f"{SEGMENT_PREFIX}{os.getuid()}-" + "0" * 16, "pid": 1}
    forged["handle"] = {**handle, "fd": 3, "dev": 0, "ino": 0, "nbytes": 1 << 16}
    stranger.put("made", forged)  # signed with another secret
    with pytest.raises(TimeoutError, match=r"did not write .*HMAC does not match"):
        open_segment(signed, _meeting(1), 1 << 16, SHORT)
    signed.store.set(SEGMENT_KEY + "made", "junk")
    with pytest.raises(TimeoutError, match="not a phalanx value"):
        open_segment(signed, _meeting(1), 1 << 16, SHORT)
    signed.put("made", forged)  # validly signed, but another group's (other nonces)
    with pytest.raises(TimeoutError, match=r"another group \(replayed\)"):
        open_segment(signed, _meeting(1, nonces=("c0", "d1")), 1 << 16, SHORT)


def test_a_stranger_cannot_preempt_the_record() -> None:
    """Forged first, then the real creator: the peer takes the creator's."""
    signed = _signed()
    signed.store.set(SEGMENT_KEY + "made", 'phx1 - {"nonces": ["a0", "b1"]}')
    (path, seg0), (_, seg1) = _pair(signed, visible=True)
    assert not os.path.exists(path)
    seg0.close()
    seg1.close()


def test_a_creators_failure_reaches_the_peers_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    def full(nbytes: int, memfd: bool) -> Handle:
        raise SegmentError("could not reserve: enlarge /dev/shm (docker run --shm-size)")

    monkeypatch.setattr("phalanx.comm.shm.segment.create", full)
    start = time.monotonic()
    out = _pair(_signed(), visible=True)
    assert time.monotonic() - start < 8  # the timeout is 10 s
    assert isinstance(out[0], SegmentError)
    assert isinstance(out[1], RuntimeError) and "enlarge /dev/shm" in str(out[1])
    assert "rank 0 could not make the group's segment" in str(out[1])


@pytest.mark.parametrize(
    "name",
    [
        "/etc/passwd",
        "../../tmp/x",
        f"{SEGMENT_PREFIX}{os.getuid()}-" + "0" * 15,
        f"{SEGMENT_PREFIX}{os.getuid()}-" + "0" * 16 + "\n",
        f"{SEGMENT_PREFIX}{os.getuid()}-" + "0" * 16 + "/..",
        f"{SEGMENT_PREFIX}{os.getuid() + 1}-" + "0" * 16,
        f"{SEGMENT_PREFIX}{os.getuid()}-" + "G" * 16,
        17,
    ],
)
def test_only_phalanx_names_of_this_uid_are_taken(name: object) -> None:
    with pytest.raises(SegmentError, match="not phalanx's own"):
        check_name(name)


def _handle(path: Path, **changes: Any) -> Handle:
    st = path.lstat()
    fields: dict[str, Any] = dict(kind="file", name=path.name, pid=os.getpid(), fd=0)
    fields.update(dev=st.st_dev)
    fields.update(ino=st.st_ino, nbytes=st.st_size)
    fields.update(changes)
    return Handle(**fields)


@pytest.fixture
def in_shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for /dev/shm, so that these files cannot collide with real segments."""
    monkeypatch.setattr(segment_file, "SHM_DIR", str(tmp_path))
    return tmp_path


def _name() -> str:
    return f"{SEGMENT_PREFIX}{os.getuid()}-{os.urandom(8).hex()}"


def test_files_that_are_not_the_creators_are_refused(in_shm: Path) -> None:
    good = in_shm / _name()
    good.write_bytes(b"\0" * 4096)
    good.chmod(0o600)
    os.close(open_handle(_handle(good)))  # the control: taken
    link = in_shm / _name()
    link.symlink_to(good)
    with pytest.raises(SegmentError, match="symbolic link"):
        open_handle(_handle(good, name=link.name))
    with pytest.raises(SegmentError, match="another inode"):
        open_handle(_handle(good, ino=good.stat().st_ino + 1))
    with pytest.raises(SegmentError, match="bytes, not"):
        open_handle(_handle(good, nbytes=8192))
    good.chmod(0o644)
    with pytest.raises(SegmentError, match="mode 644, not 600"):
        open_handle(_handle(good))
    fifo = in_shm / _name()
    os.mkfifo(fifo, 0o600)
    with pytest.raises(SegmentError, match="not a regular file"):
        open_handle(_handle(fifo))  # O_NONBLOCK: a FIFO does not block the open


def test_a_memfd_handle_must_link_to_that_memfd(in_shm: Path) -> None:
    plain = in_shm / _name()
    plain.write_bytes(b"\0" * 4096)
    plain.chmod(0o600)
    fd = os.open(plain, os.O_RDWR)
    try:
        with pytest.raises(SegmentError, match="not the memfd"):
            open_handle(_handle(plain, kind="memfd", fd=fd))
    finally:
        os.close(fd)


def test_one_host_check_names_every_rank_and_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PHALANX_JOB_SECRET", raising=False)
    store = dist.HashStore()
    peer = {"pid": 123, "start": 456, "host": "elsewhere", "nonce": "n"}
    SignedStore(store, None, "/0/shm").put("phalanx_shm/host/1", peer)
    with pytest.raises(ValueError, match="rank 1 on elsewhere; set PHALANX_SHM_HOST alike"):
        check_one_host(store, 0, 2, timedelta(seconds=2))


def test_peer_processes_are_watched_only_where_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PHALANX_JOB_SECRET", raising=False)
    me = (os.getpid(), process_start(os.getpid()) or 0)
    for start, expected in ((me[1], [me, me]), (me[1] + 1, None)):  # + 1: another pid namespace
        store = dist.HashStore()
        peer = {"pid": me[0], "start": start, "host": socket.gethostname(), "nonce": "n"}
        SignedStore(store, None, "/0/shm").put("phalanx_shm/host/1", peer)
        assert check_one_host(store, 0, 2, timedelta(seconds=2)).processes == expected
