"""A TCPStore client in pure Python, for the processes that must not import torch.

It speaks to torch's server and to :class:`~phalanx.comm.tcpstore.server.StoreServer` alike,
with the methods of ``torch.distributed.Store`` that phalanx calls (``set``, ``get``, ``add``,
``compare_set``, ``check``, ``wait``, ``multi_get``, ``multi_set``, ``delete_key``,
``num_keys``, ``list_keys``, ``append``, ``clone``, ``timeout`` / ``set_timeout``), and
torch's errors' kinds: a wait or ``get`` that runs out of time raises :class:`StoreTimeout` (a
``RuntimeError``, as torch's ``DistStoreError`` is), a lost server ``ConnectionError``. Keys get
torch's ``/`` prefix, so a torch client and this one see the same keys. One request at a time
per client (a lock); :meth:`clone` gives another connection, for another thread.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

from phalanx.comm.tcpstore import wire
from phalanx.comm.tcpstore.wire import Query

if TYPE_CHECKING:
    from phalanx.comm.tcpstore.server import StoreServer

__all__ = ["StoreClient", "StoreTimeout"]

T = TypeVar("T")


class StoreTimeout(RuntimeError):
    """A wait for keys ran out of time (torch raises ``DistStoreError``, a ``RuntimeError``)."""


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class StoreClient:
    """One connection to the store at ``host:port``; ``timeout`` bounds every wait."""

    def __init__(
        self, host: str, port: int, timeout: timedelta, server: StoreServer | None = None
    ) -> None:
        self.host, self.port = host, port
        self._timeout = timeout
        self._server = server
        """The server this client's process hosts, closed with it (torch's master store)."""
        self._lock = threading.Lock()
        self._unread = bytearray()
        """Bytes received but not consumed yet (a cancelled wait may answer twice at once)."""
        self._sock = socket.create_connection((host, port), timeout=self._seconds())
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = secrets.randbits(32)
        with self._lock:
            self._sock.sendall(
                bytes([Query.VALIDATE])
                + wire.u32(wire.MAGIC)
                + bytes([Query.PING])
                + wire.u32(nonce)
            )
            if self._answer(wire.Reader.u32) != nonce:
                raise ConnectionError(f"{host}:{port} is not a TCPStore (wrong answer to a ping)")

    # -- torch's Store API ------------------------------------------------------------------

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    def set(self, key: str, value: str | bytes) -> None:
        self._post(bytes([Query.SET]) + self._key(key) + wire.blob(_bytes(value)))

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._ask(bytes([Query.GET]) + self._key(key), wire.Reader.value)

    def add(self, key: str, amount: int) -> int:
        return self._ask(bytes([Query.ADD]) + self._key(key) + wire.i64(amount), wire.Reader.i64)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        request = self._key(key) + wire.blob(_bytes(expected)) + wire.blob(_bytes(desired))
        return self._ask(bytes([Query.COMPARE_SET]) + request, wire.Reader.value)

    def check(self, keys: Sequence[str]) -> bool:
        answer = self._ask(bytes([Query.CHECK]) + self._keys(keys), wire.Reader.u8)
        return answer == wire.READY

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        self.wait(keys)
        return self._ask(
            bytes([Query.MULTI_GET]) + self._keys(keys),
            lambda r: [r.value() for _ in keys],
        )

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        pairs = b"".join(self._key(k) + wire.blob(_bytes(v)) for k, v in zip(keys, values))
        self._post(bytes([Query.MULTI_SET]) + wire.u64(len(keys)) + pairs)

    def delete_key(self, key: str) -> bool:
        return self._ask(bytes([Query.DELETE_KEY]) + self._key(key), wire.Reader.i64) > 0

    def num_keys(self) -> int:
        return self._ask(bytes([Query.GETNUMKEYS]), wire.Reader.i64)

    def list_keys(self) -> list[str]:
        """Every key (not the queues), as ``set`` was given it."""
        raw = self._ask(bytes([Query.LIST_KEYS]), lambda r: [r.key() for _ in range(r.i64())])
        return [k.removeprefix(wire.KEY_PREFIX) for k in raw]

    def append(self, key: str, value: str | bytes) -> None:
        self._post(bytes([Query.APPEND]) + self._key(key) + wire.blob(_bytes(value)))

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        """Return once every key exists; :class:`StoreTimeout` after ``timeout`` (default: the
        store's)."""
        limit = (timeout or self._timeout).total_seconds()
        deadline = time.monotonic() + limit
        with self._lock:
            self._send(bytes([Query.WAIT]) + self._keys(keys))
            try:
                self._answer(wire.Reader.u8, deadline)
                return
            except TimeoutError:
                pass
            self._send(bytes([Query.CANCEL_WAIT]))
            while self._answer(wire.Reader.u8) != wire.WAIT_CANCELED:  # the keys came meanwhile
                pass
        raise StoreTimeout(
            f"wait timeout after {limit * 1000:.0f}ms, keys: "
            + ", ".join(wire.KEY_PREFIX + k for k in keys)
        )

    def clone(self) -> StoreClient:
        """Another connection to the same store (the server stays with this client)."""
        return StoreClient(self.host, self.port, self._timeout)

    def close(self) -> None:
        """Close the connection, and the server if this client's process hosts it."""
        self._sock.close()
        if self._server is not None:
            self._server.close()

    def __del__(self) -> None:  # torch's master store stops serving when it is dropped
        if getattr(self, "_server", None) is not None:
            self._server.close()  # type: ignore[union-attr]

    # -- the connection ---------------------------------------------------------------------

    def _seconds(self) -> float:
        return max(self._timeout.total_seconds(), 0.001)

    @staticmethod
    def _key(key: str) -> bytes:
        return wire.blob((wire.KEY_PREFIX + key).encode("utf-8", "surrogateescape"))

    def _keys(self, keys: Sequence[str]) -> bytes:
        return wire.u64(len(keys)) + b"".join(self._key(k) for k in keys)

    def _post(self, data: bytes) -> None:
        """A request without an answer."""
        with self._lock:
            self._send(data)

    def _ask(self, data: bytes, parse: Callable[[wire.Reader], T]) -> T:
        with self._lock:
            self._send(data)
            return self._answer(parse)

    def _answer(self, parse: Callable[[wire.Reader], T], deadline: float | None = None) -> T:
        """The next answer, read by ``parse``; ``TimeoutError`` past ``deadline`` (monotonic;
        None: the store's timeout, after which the connection counts as lost)."""
        while True:
            reader = wire.Reader(self._unread)
            try:
                answer = parse(reader)
            except wire.Incomplete:
                reader.release()
                self._unread += self._recv_some(deadline)
                continue
            reader.release()
            del self._unread[: reader.offset]
            return answer

    def _send(self, data: bytes) -> None:
        try:
            self._sock.settimeout(self._seconds())
            self._sock.sendall(data)
        except OSError as exc:
            raise self._lost(exc) from None

    def _recv_some(self, deadline: float | None = None) -> bytes:
        left = self._seconds() if deadline is None else deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        self._sock.settimeout(left)
        try:
            data = self._sock.recv(65536)
        except TimeoutError:
            if deadline is not None:
                raise
            raise self._lost(TimeoutError(f"no answer within {self._seconds():g} s")) from None
        except OSError as exc:
            raise self._lost(exc) from None
        if not data:
            raise self._lost(ConnectionError("the server closed the connection"))
        return data

    def _lost(self, exc: BaseException) -> ConnectionError:
        return ConnectionError(f"lost the store at {self.host}:{self.port}: {exc}")
