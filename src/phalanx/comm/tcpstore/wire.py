"""The bytes of torch's TCPStore protocol (``torch/csrc/distributed/c10d/TCPStore*.cpp``).

A client opens with ``VALIDATE`` and the magic number, then ``PING`` with a nonce that the server
echoes. Each request is one query-type byte and its arguments; integers are in the machine's
byte order (little-endian on every platform torch ships for), a key or value is a ``uint64``
length and its bytes. ``SET``, ``APPEND``, ``MULTI_SET``, ``QUEUE_PUSH`` and ``VALIDATE`` get no
reply; ``WAIT`` and ``BARRIER`` get theirs when the keys exist or the barrier is full.
torch's client puts ``/`` before every key it is given (:data:`KEY_PREFIX`).

Checked against torch 2.13's own client and server, byte for byte
(``tests/unit/test_tcpstore.py``).
"""

from __future__ import annotations

import enum
import struct

__all__ = [
    "KEY_PREFIX",
    "MAGIC",
    "MAX_KEYS",
    "MAX_KEY_LEN",
    "MAX_VALUE_LEN",
    "Incomplete",
    "ProtocolError",
    "Query",
    "Reader",
    "blob",
    "i64",
    "u32",
    "u64",
]

MAGIC = 0x3C85F7CE
"""What ``VALIDATE`` carries: a connection that opens with anything else is not a store client."""
KEY_PREFIX = "/"
MAX_KEY_LEN = 8 * 1024
MAX_VALUE_LEN = 8 * 1024 * 1024
MAX_KEYS = 128 * 1024
"""torch's libuv server's limits (key bytes, value bytes, keys in one request); a request over
them closes the connection, there as here."""

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")


class Query(enum.IntEnum):
    """The first byte of a request (torch's ``QueryType``)."""

    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13
    QUEUE_PUSH = 14
    QUEUE_POP = 15
    QUEUE_LEN = 16
    LIST_KEYS = 17
    BARRIER = 18


READY, NOT_READY = 0, 1
"""``CHECK``'s answer."""
STOP_WAITING, WAIT_CANCELED = 0, 1
"""``WAIT``'s and ``CANCEL_WAIT``'s answers."""


class Incomplete(Exception):
    """The buffer ends inside a request: wait for more bytes."""


class ProtocolError(Exception):
    """Not a request of this protocol, or one over the limits: close the connection."""


def u32(value: int) -> bytes:
    return _U32.pack(value)


def u64(value: int) -> bytes:
    return _U64.pack(value)


def i64(value: int) -> bytes:
    return _I64.pack(value)


def blob(data: bytes) -> bytes:
    """A key or value: its length, then its bytes."""
    return _U64.pack(len(data)) + data


class Reader:
    """Reads one request from the front of a buffer; :class:`Incomplete` when it is cut short."""

    def __init__(self, buffer: bytes | bytearray | memoryview) -> None:
        self._view = memoryview(buffer)
        self.offset = 0

    def release(self) -> None:
        """Let the buffer be resized again (call before changing it)."""
        self._view.release()

    def _take(self, n: int) -> memoryview:
        if self.offset + n > len(self._view):
            raise Incomplete
        piece = self._view[self.offset : self.offset + n]
        self.offset += n
        return piece

    def u8(self) -> int:
        return self._take(1)[0]

    def u32(self) -> int:
        return int(_U32.unpack(self._take(4))[0])

    def u64(self) -> int:
        return int(_U64.unpack(self._take(8))[0])

    def i64(self) -> int:
        return int(_I64.unpack(self._take(8))[0])

    def key(self) -> str:
        size = self.u64()
        if size > MAX_KEY_LEN:
            raise ProtocolError(f"a key of {size} bytes (at most {MAX_KEY_LEN})")
        return bytes(self._take(size)).decode("utf-8", "surrogateescape")

    def value(self) -> bytes:
        size = self.u64()
        if size > MAX_VALUE_LEN:
            raise ProtocolError(f"a value of {size} bytes (at most {MAX_VALUE_LEN})")
        return bytes(self._take(size))

    def keys(self) -> list[str]:
        count = self.u64()
        if count > MAX_KEYS:
            raise ProtocolError(f"{count} keys in one request (at most {MAX_KEYS})")
        return [self.key() for _ in range(count)]
