"""A TCPStore server in pure Python: torch's clients (``TCPStore(..., is_master=False)``) and
:class:`~phalanx.comm.tcpstore.client.StoreClient` connect to it alike.

One daemon thread serves every connection with a selector. The semantics are those of torch's
libuv server: ``get`` of a missing key answers an empty value (clients wait first), ``add`` keeps
a decimal string, ``compare_set`` sets when the current value equals the expected one (or the key
is missing and the expected value empty) and answers the value it leaves, a ``wait`` is answered
once all its keys exist (a non-empty queue counts), ``queue_push`` wakes one waiter, a barrier
key counts arrivals and lets everyone through from the ``world_size``-th on. A connection that
does not open with ``VALIDATE`` and the magic number, sends an unknown query or exceeds the limits
is closed; the others never notice.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import sys
import threading
from collections import deque
from collections.abc import Callable

from phalanx.comm.tcpstore import wire
from phalanx.comm.tcpstore.wire import Query

__all__ = ["StoreServer"]

_RECV = 65536


class _Conn:
    """One client connection: what it sent that is not parsed yet, what waits to go out."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.inbox = bytearray()
        self.outbox = bytearray()
        self.validated = False
        self.awaited = 0
        """Keys of its pending ``WAIT`` that do not exist yet (0: not waiting)."""


class StoreServer:
    """Serve the TCPStore protocol on ``listener`` (bound and listening) until :meth:`close`."""

    def __init__(self, listener: socket.socket) -> None:
        listener.setblocking(False)
        self._listener = listener
        self.port: int = listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._closing = False
        self._data: dict[str, bytes] = {}
        self._queues: dict[str, deque[bytes]] = {}
        self._waiters: dict[str, list[_Conn]] = {}
        self._barriers: dict[str, tuple[int, list[_Conn]]] = {}
        self._handlers: dict[int, Callable[[_Conn, wire.Reader], Callable[[], None]]] = {
            Query.PING: self._ping,
            Query.SET: self._set,
            Query.COMPARE_SET: self._compare_set,
            Query.GET: self._get,
            Query.ADD: self._add,
            Query.CHECK: self._check,
            Query.WAIT: self._wait,
            Query.GETNUMKEYS: self._num_keys,
            Query.DELETE_KEY: self._delete_key,
            Query.APPEND: self._append,
            Query.MULTI_GET: self._multi_get,
            Query.MULTI_SET: self._multi_set,
            Query.CANCEL_WAIT: self._cancel_wait,
            Query.QUEUE_PUSH: self._queue_push,
            Query.QUEUE_POP: self._queue_pop,
            Query.QUEUE_LEN: self._queue_len,
            Query.LIST_KEYS: self._list_keys,
            Query.BARRIER: self._barrier,
        }
        self._thread = threading.Thread(target=self._serve, name="phalanx-store", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and close every connection (idempotent; returns once stopped)."""
        if self._closing:
            return
        self._closing = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if threading.current_thread() is not self._thread and not sys.is_finalizing():
            self._thread.join()  # (a finalizing interpreter no longer runs daemon threads)

    # -- the loop ---------------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            while not self._closing:
                for key, events in self._selector.select():
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(64)
                    else:
                        conn = key.data
                        if events & selectors.EVENT_WRITE:
                            self._flush(conn)
                        if events & selectors.EVENT_READ:
                            self._read(conn)
        finally:
            for key in list(self._selector.get_map().values()):
                with contextlib.suppress(OSError):
                    key.fileobj.close()  # type: ignore[union-attr]
            self._selector.close()
            self._wake_w.close()

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:  # the peer gave up before we got to it
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._selector.register(sock, selectors.EVENT_READ, _Conn(sock))

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(_RECV)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        conn.inbox += data
        try:
            self._handle(conn)
        except wire.ProtocolError:
            self._drop(conn)

    def _handle(self, conn: _Conn) -> None:
        """Carry out every whole request at the front of ``conn``'s inbox."""
        while conn.inbox:
            reader = wire.Reader(conn.inbox)
            try:
                query = reader.u8()
                if not conn.validated:
                    if query != Query.VALIDATE or reader.u32() != wire.MAGIC:
                        raise wire.ProtocolError("not a TCPStore client")
                    conn.validated = True
                    act: Callable[[], None] = lambda: None  # noqa: E731
                else:
                    handler = self._handlers.get(query)
                    if handler is None:
                        raise wire.ProtocolError(f"unknown query {query}")
                    act = handler(conn, reader)  # parses the whole request first
            except wire.Incomplete:
                return
            finally:
                reader.release()
            del conn.inbox[: reader.offset]
            act()

    def _send(self, conn: _Conn, data: bytes) -> None:
        if conn.sock.fileno() < 0:
            return
        if not conn.outbox:
            try:
                sent = conn.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._drop(conn)
                return
            data = data[sent:]
            if not data:
                return
            self._selector.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
        conn.outbox += data

    def _flush(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.outbox)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        del conn.outbox[:sent]
        if not conn.outbox:
            self._selector.modify(conn.sock, selectors.EVENT_READ, conn)

    def _drop(self, conn: _Conn) -> None:
        self._forget_wait(conn)
        for _, waiting in self._barriers.values():
            if conn in waiting:
                waiting.remove(conn)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()

    # -- the store --------------------------------------------------------------------------

    def _present(self, key: str) -> bool:
        return key in self._data or bool(self._queues.get(key))

    def _changed(self, key: str, one: bool = False) -> None:
        """``key`` now exists: answer the waits it completes (``one``: the first only)."""
        waiting = self._waiters.get(key)
        if not waiting:
            return
        for conn in list(waiting):
            waiting.remove(conn)
            conn.awaited -= 1
            if conn.awaited == 0:
                self._send(conn, bytes([wire.STOP_WAITING]))
                if one:
                    break
        if not waiting:
            del self._waiters[key]

    def _forget_wait(self, conn: _Conn) -> None:
        if not conn.awaited:
            return
        conn.awaited = 0
        for key in [k for k, waiting in self._waiters.items() if conn in waiting]:
            self._waiters[key] = [c for c in self._waiters[key] if c is not conn]
            if not self._waiters[key]:
                del self._waiters[key]

    def _store(self, key: str, value: bytes) -> None:
        self._data[key] = value
        self._changed(key)

    # -- one handler per query: parse, then return what carries it out ----------------------

    def _ping(self, conn: _Conn, r: wire.Reader) -> Callable[[], None]:
        nonce = r.u32()
        return lambda: self._send(conn, wire.u32(nonce))

    def _set(self, conn: _Conn, r: wire.Reader) -> Callable[[], None]:
        key, value = r.key(), r.value()
        return lambda: self._store(key, value)

    def _compare_set(self, conn: _Conn, r: wire.Reader) -> Callable[[], None]:
        key, expected, desired = r.key(), r.value(), r.value()

        def act() -> None:
            current = self._data.get(key)
            if current is None:
                if expected:
                    answer = expected  # torch's answer for a missing key and a non-empty guess
                else:
                    self._data[key] = answer = desired
            else:
                if current == expected:
                    self._data[key] = desired
                answer = self._data[key]
            self._changed(key)
            self._send(conn, wire.blob(answer))

        return act

    def _get(self, conn: _Conn, r: wire.Reader) -> Callable[[], None]:
        key = r.key()
        return lambda: self._send(conn, wire.blob(self._data.get(key, b"")))

    def _add(self, conn: _Conn, r: wire.Reader) -> Callable[[], None]:
        key, amount = r.key(), r.i64()

        def act() -> None:
            try:
                total = int(self._data.get(key, b"0")) + amount
            except ValueError:
                raise wire.ProtocolError(f"add to {key!r}, whose value is not a number") from None
            self._store(key, str(total).encode())
            self._send(conn, wire.i64(total))

        return act

    def _check(self, conn: _Conn, r: wire.Reader) -> Callable[[], None]:
        keys = r.keys()
        ready = all(self._present(k) for k in keys)
        return lambda: self._send(conn, bytes([wire.READY if ready else wire.NOT_READY]))

    def _wait(self, conn: _Conn, r: wire.Reader) -> Callable[[], None]:
        keys = r.keys()

        def act() -> None:
            if all(self._present(k) for k in keys):
                self._send(conn, bytes([wire.STOP_WAITING]))
                return
            self._forget_wait(conn)
            missing = [k for k in keys if k not in self._data]
            for key in missing:
                self._waiters.setdefault(key, []).append(conn)
            conn.awaited = len(missing)

        return act

    def _num_keys(self, conn: _Conn, r: wire.Reader) -> Callable[[], None]:
        return lambda: self._send(conn, wire.i64(len(self._data)))

    def _delete_key(self, conn: _Conn, r: wire.Reader) -> Callable[[], None]:
        key = r.key()
        return lambda: self._send(conn, wire.i64(int(self._data.pop(key, None) is not None)))

    def _append(self, conn: _Conn, r: wire.Reader) -> Callable[[], None]:
        key, value = r.key(), r.value()
        return lambda: self._store(key, self._data.get(key, b"") + value)

    def _multi_get(self, conn: _Conn, r: wire.Reader) -> Callable[[], None]:
        keys = r.keys()
        return lambda: self._send(conn, b"".join(wire.blob(self._data.get(k, b"")) for k in keys))

    def _multi_set(self, conn: _Conn, r: wire.Reader) -> Callable[[], None]:
        count = r.u64()
        if count > wire.MAX_KEYS:
            raise wire.ProtocolError(f"{count} keys in one request (at most {wire.MAX_KEYS})")
        pairs = [(r.key(), r.value()) for _ in range(count)]

        def act() -> None:
            for key, value in pairs:
                self._store(key, value)

        return act

    def _cancel_wait(self, conn: _Conn, r: wire.Reader) -> Callable[[], None]:
        def act() -> None:
            self._forget_wait(conn)
            self._send(conn, bytes([wire.WAIT_CANCELED]))

        return act

    def _queue_push(self, conn: _Conn, r: wire.Reader) -> Callable[[], None]:
        key, value = r.key(), r.value()

        def act() -> None:
            self._queues.setdefault(key, deque()).append(value)
            self._changed(key, one=True)

        return act

    def _queue_pop(self, conn: _Conn, r: wire.Reader) -> Callable[[], None]:
        key = r.key()

        def act() -> None:
            queue = self._queues.setdefault(key, deque())
            answer = wire.i64(len(queue))
            if queue:
                answer += wire.blob(queue.popleft())
            self._send(conn, answer)

        return act

    def _queue_len(self, conn: _Conn, r: wire.Reader) -> Callable[[], None]:
        key = r.key()
        return lambda: self._send(conn, wire.i64(len(self._queues.get(key, ()))))

    def _list_keys(self, conn: _Conn, r: wire.Reader) -> Callable[[], None]:
        def act() -> None:
            keys = [wire.blob(k.encode("utf-8", "surrogateescape")) for k in self._data]
            self._send(conn, wire.i64(len(keys)) + b"".join(keys))

        return act

    def _barrier(self, conn: _Conn, r: wire.Reader) -> Callable[[], None]:
        key, world_size = r.key(), r.i64()

        def act() -> None:
            count, waiting = self._barriers.get(key, (0, []))
            count += 1
            waiting.append(conn)
            if count >= world_size:
                self._barriers[key] = (count, [])
                for member in waiting:
                    self._send(member, bytes([wire.STOP_WAITING]))  # may drop one: not from here
            else:
                self._barriers[key] = (count, waiting)

        return act
