"""phalanx's pure-Python TCPStore (``phalanx.comm.tcpstore``) against torch's own: torch's
client gets the same answers from our server as from torch's, our client the same from either
server as torch's client does, and both see one another's keys."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from phalanx.comm import tcpstore
from phalanx.comm.store import host_store

SHORT = timedelta(seconds=0.3)
LONG = timedelta(seconds=20)


def _script(store: Any) -> list[object]:
    """Every operation phalanx or torch's process groups use, and the corners of each."""
    out: list[object] = []

    def do(fn: Callable[[], object]) -> None:
        try:
            out.append(fn())
        except RuntimeError as exc:  # torch's DistStoreError and our StoreTimeout
            out.append(("RuntimeError", str(exc).split(",")[0]))

    do(lambda: store.set("a", b"1"))
    do(lambda: store.set("text", "str value"))
    do(lambda: store.get("a"))
    do(lambda: store.get("text"))
    do(lambda: store.add("n", 5))
    do(lambda: store.add("n", -7))
    do(lambda: store.get("n"))
    do(lambda: store.compare_set("a", b"1", b"2"))
    do(lambda: store.compare_set("a", b"wrong", b"3"))
    do(lambda: store.compare_set("missing", b"", b"made"))
    do(lambda: store.compare_set("missing2", b"guess", b"x"))
    do(lambda: store.check(["a", "n"]))
    do(lambda: store.check(["a", "nope"]))
    do(lambda: store.wait(["a", "n"]))
    do(lambda: store.wait(["never"], SHORT))
    do(lambda: store.multi_get(["a", "n", "text"]))
    do(lambda: store.multi_set(["m1", "m2"], [b"x", "y"]))
    do(lambda: store.multi_get(["m1", "m2"]))
    do(lambda: store.append("ap", b"xy"))
    do(lambda: store.append("ap", b"z"))
    do(lambda: store.get("ap"))
    do(lambda: store.delete_key("m1"))
    do(lambda: store.delete_key("m1"))
    do(lambda: store.check(["m1"]))
    do(lambda: store.num_keys())
    do(lambda: sorted(store.list_keys()))
    do(lambda: store.set("", b"empty key"))
    do(lambda: store.get(""))
    do(lambda: store.set("big", bytes(range(256)) * 4096))
    do(lambda: store.get("big") == bytes(range(256)) * 4096)
    return out


SERVE = (
    "import sys, time; from datetime import timedelta; from phalanx.comm import tcpstore; "
    "store, port = tcpstore.host('127.0.0.1', 0, timedelta(seconds=20)); print(port, flush=True); "
    "sys.stdin.read()"
)
"""Our server in a process of its own, as the launcher's is: torch's client holds the GIL in
``list_keys`` and ``queue_len``, so a server in the same process would never answer them."""


@pytest.fixture(params=["torch", "phalanx"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[str, int]]:
    """A store server of either kind on 127.0.0.1; yields its address."""
    if request.param == "torch":
        keep, port = host_store("127.0.0.1", 0, LONG)
        yield "127.0.0.1", port
        del keep
        return
    env = {**os.environ, "PYTHONPATH": str(Path(tcpstore.__file__).parents[3])}
    with subprocess.Popen(
        [sys.executable, "-c", SERVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    ) as proc:
        try:
            assert proc.stdout is not None
            yield "127.0.0.1", int(proc.stdout.readline())
        finally:
            proc.kill()


def _client(kind: str, addr: tuple[str, int]) -> Any:
    if kind == "torch":
        store = dist.TCPStore(addr[0], addr[1], None, False, LONG)
        store.set_timeout(LONG)
        return store
    return tcpstore.connect(addr[0], addr[1], LONG)


def _reference() -> list[object]:
    keep, port = host_store("127.0.0.1", 0, LONG)
    try:
        return _script(_client("torch", ("127.0.0.1", port)))
    finally:
        del keep


@pytest.mark.parametrize("client", ["torch", "phalanx"])
def test_every_operation_answers_as_torchs_client_on_torchs_server(
    server: tuple[str, int], client: str
) -> None:
    got = _script(_client(client, server))
    assert got == _reference()
    assert got[14] == ("RuntimeError", "wait timeout after 300ms")  # the timeout is an error


def test_each_client_sees_the_others_keys_on_our_server() -> None:
    host, port = tcpstore.host("127.0.0.1", 0, LONG)
    theirs = _client("torch", ("127.0.0.1", port))
    ours = tcpstore.connect("127.0.0.1", port, LONG)
    theirs.set("from-torch", b"t")
    ours.set("from-phalanx", b"p")
    assert ours.get("from-torch") == b"t"
    assert theirs.get("from-phalanx") == b"p"
    assert host.get("from-torch") == b"t"


@pytest.mark.parametrize("waiter", ["torch", "phalanx"])
def test_a_wait_returns_when_another_client_sets_the_last_key(waiter: str) -> None:
    host, port = tcpstore.host("127.0.0.1", 0, LONG)
    store = _client(waiter, ("127.0.0.1", port))
    host.set("k1", b"1")
    done = threading.Event()
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            store.wait(["k1", "k2", "k3"])
        except BaseException as exc:
            errors.append(exc)
        done.set()

    threading.Thread(target=wait, daemon=True).start()
    host.set("k2", b"2")
    assert not done.wait(0.2)  # k3 is still missing
    host.add("k3", 1)
    assert done.wait(LONG.total_seconds())
    assert not errors


def test_queues_and_barriers_behave_as_torchs() -> None:
    _serving, port = tcpstore.host("127.0.0.1", 0, LONG)
    a = _client("torch", ("127.0.0.1", port))
    b = _client("torch", ("127.0.0.1", port))
    a.queue_push("q", b"one")
    a.queue_push("q", b"two")
    assert [b.queue_pop("q"), b.queue_pop("q")] == [b"one", b"two"]
    popped: list[bytes] = []
    t = threading.Thread(target=lambda: popped.append(b.queue_pop("q2")), daemon=True)
    t.start()
    a.queue_push("q2", b"late")
    t.join(LONG.total_seconds())
    assert popped == [b"late"]
    passed = threading.Event()
    threading.Thread(target=lambda: (a.barrier("b", 2), passed.set()), daemon=True).start()
    assert not passed.wait(0.2)
    b.barrier("b", 2)
    assert passed.wait(LONG.total_seconds())


def test_a_stranger_is_disconnected_and_the_clients_never_notice() -> None:
    host, port = tcpstore.host("127.0.0.1", 0, LONG)
    ours = tcpstore.connect("127.0.0.1", port, LONG)
    for junk in (b"GET / HTTP/1.1\r\n\r\n", b"\x00\x00\x00\x00\x00", b"\x00" + bytes(4) * 3):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(junk)
            assert s.recv(16) == b""  # closed by the server
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:  # a key over the limit
        s.sendall(b"\x00\xce\xf7\x85\x3c" + b"\x03" + (1 << 20).to_bytes(8, "little"))
        assert s.recv(16) == b""
    ours.set("k", b"v")
    assert host.get("k") == b"v"


def test_a_closed_server_stops_listening_and_its_clients_see_a_connection_error() -> None:
    host, port = tcpstore.host("127.0.0.1", 0, LONG)
    other = tcpstore.connect("127.0.0.1", port, LONG)
    host.close()
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
        other.get("k")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5)
    with pytest.raises(ConnectionError, match=f"rendezvous store at 127.0.0.1:{port}"):
        tcpstore.connect("127.0.0.1", port, timedelta(seconds=0.2))
