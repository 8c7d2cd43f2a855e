"""Signed values in the rendezvous stores: every value phalanx writes carries an HMAC.

torch's TCPStore has no authentication: anyone who reaches its port can read, write and delete
keys. phalanx cannot stop that, but it can refuse to *believe* what it did not write. Every value
of phalanx's own store protocol (config, membership, failures, checkpoint sessions, hang
requests, progress, fingerprints, heartbeats) is one frame::

    phx1 <tag> <json>

where ``tag`` is the hex HMAC-SHA256, under the job secret (``PHALANX_JOB_SECRET``), of the
store's *scope* (a per-job, per-generation nonce), the full key name and the JSON. So a value
cannot be forged without the secret, nor replayed under another key or into another generation;
nor into another job where the scope holds a per-job nonce (a join record's). Scopes without one
(the agent store's config, torchrun-hosted stores) only name the run id: a later job that reuses
the secret and run id can be fed recorded values (docs/security.md).

Without a secret (``init_process_group`` called by hand, no ``PHALANX_JOB_SECRET``) the tag is
``-``: values are still framed and validated, so junk is rejected, but nothing is authenticated.
A process with a secret rejects unsigned values, and a process without one rejects signed
values: a mixed job fails instead of trusting anyone.

A rejected value is treated as absent and logged once per key (logger ``phalanx.comm.signed``); it
never raises out of :meth:`SignedStore.get`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import time
import types
import typing
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from phalanx.comm import auth

if TYPE_CHECKING:
    from typing import TypeAlias

    import torch.distributed as dist

    from phalanx.comm.tcpstore import StoreClient

    AnyStore: TypeAlias = dist.Store | StoreClient
    """torch's stores, and the pure-Python client of the processes without torch."""

__all__ = ["JobSecretError", "Rejected", "SignedStore", "as_record", "claimed"]

T = TypeVar("T")
MAGIC = "phx1"
UNSIGNED = "-"
POLL_S = 0.05
_DOMAIN = b"phalanx-store/1"
_ABSENT = "\0phalanx: no value"
log = logging.getLogger(__name__)
_WARNED: set[str] = set()


class Rejected(ValueError):
    """A store value that is not a well-formed frame signed with this job's secret."""


class JobSecretError(RuntimeError):
    """This process's ``PHALANX_JOB_SECRET`` is not the one of the job it tries to join."""


def _identity(value: Any) -> Any:
    return value


def _warn_once(key: str, why: Rejected) -> None:
    if key in _WARNED:
        return
    _WARNED.add(key)
    log.warning(
        "ignored the value of store key %r: %s. Only processes with this job's secret can "
        "write phalanx's keys; another process reached the store (see docs/security.md)",
        key,
        why,
    )


@dataclasses.dataclass(frozen=True)
class SignedStore:
    """Typed, signed JSON values over a c10d store (``put`` / ``get`` and friends)."""

    store: AnyStore
    """The c10d store that holds the frames."""
    secret: bytes | None = dataclasses.field(repr=False)
    """The job secret (None: frames are unsigned)."""
    scope: str
    """Bound into every tag: the job and generation the values belong to."""
    prefix: str = ""
    """Prepended to every key (and part of the signed key name)."""

    def sub(self, prefix: str) -> SignedStore:
        """The same signer for the keys under ``prefix``."""
        return dataclasses.replace(self, prefix=self.prefix + prefix)

    def over(self, store: AnyStore) -> SignedStore:
        """The same signer over another handle to the same store (e.g. a clone for a thread)."""
        return dataclasses.replace(self, store=store)

    @functools.cached_property
    def _keyed(self) -> hmac.HMAC:
        assert self.secret is not None
        return auth.keyed(self.secret, b"\0".join((_DOMAIN, self.scope.encode(), b"")))

    def _tag(self, key: str, payload: str) -> str:
        h = self._keyed.copy()  # the secret and scope are hashed once per signer, not per value
        h.update(f"{key}\0{payload}".encode())
        return h.hexdigest()

    def encode(self, key: str, value: object) -> str:
        """The frame of ``value`` under ``key`` (relative to :attr:`prefix`)."""
        payload = json.dumps(value, separators=(",", ":"))
        tag = UNSIGNED if self.secret is None else self._tag(self.prefix + key, payload)
        return f"{MAGIC} {tag} {payload}"

    def decode(self, key: str, raw: bytes | str, parse: Callable[[Any], T] = _identity) -> T:
        """The value of the frame ``raw`` read at ``key``, checked by ``parse``.

        Raises:
            Rejected: not a frame, a signature that does not verify, or ``parse`` refused it.
        """
        try:
            text = raw.decode("ascii") if isinstance(raw, bytes) else raw
        except UnicodeDecodeError:
            raise Rejected("it is not a phalanx value (not ASCII)") from None
        parts = text.split(" ", 2)
        if len(parts) != 3 or parts[0] != MAGIC:
            raise Rejected(f"it is not a phalanx value (no {MAGIC!r} frame)")
        _, tag, payload = parts
        if self.secret is None and tag != UNSIGNED:
            raise Rejected("it is signed, but PHALANX_JOB_SECRET is not set in this process")
        if self.secret is not None:
            if tag == UNSIGNED:
                raise Rejected("it is unsigned, but this process has a PHALANX_JOB_SECRET")
            if not hmac.compare_digest(tag, self._tag(self.prefix + key, payload)):
                raise Rejected(
                    "its HMAC does not match this process's PHALANX_JOB_SECRET (forged, or "
                    "written with another job's secret)"
                )
        try:
            return parse(json.loads(payload))
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            raise Rejected(f"it is malformed ({type(exc).__name__}: {exc})") from None

    def accept(self, key: str, raw: bytes, parse: Callable[[Any], T] = _identity) -> T | None:
        """:meth:`decode`, but a rejected value is logged once and read as None."""
        try:
            return self.decode(key, raw, parse)
        except Rejected as why:
            _warn_once(self.prefix + key, why)
            return None

    def put(self, key: str, value: object) -> None:
        """Set ``key`` to the signed frame of ``value`` (plain JSON data)."""
        self.store.set(self.prefix + key, self.encode(key, value))

    def raw(self, key: str) -> bytes | None:
        """The raw value at ``key`` or None, in one round trip and without blocking.

        ``check`` then ``get`` would race with a deletion in between, and ``get`` of a deleted
        key blocks for the store's whole timeout. A compare-and-set that can only match a value
        nobody writes returns the current value, or the expected one when the key is absent.
        """
        got = self.store.compare_set(self.prefix + key, _ABSENT, _ABSENT)
        return None if got == _ABSENT.encode() else got

    def get(self, key: str, parse: Callable[[Any], T] = _identity) -> T | None:
        """The value at ``key``; None when absent, forged or malformed (logged once)."""
        raw = self.raw(key)
        return None if raw is None else self.accept(key, raw, parse)

    def get_present(self, keys: list[str], parse: Callable[[Any], T] = _identity) -> list[T | None]:
        """The values at ``keys``, which must all exist (one round trip); None where rejected.

        Only for keys nobody deletes meanwhile: the store's ``multi_get`` of a deleted key blocks
        for its whole timeout (use :meth:`get` for those).
        """
        raws = self.store.multi_get([self.prefix + k for k in keys])
        return [self.accept(k, raw, parse) for k, raw in zip(keys, raws)]

    def exists(self, keys: list[str]) -> bool:
        """True when every key holds some value (valid or not)."""
        return bool(self.store.check([self.prefix + k for k in keys]))

    def wait_exists(self, keys: list[str], timeout: timedelta) -> None:
        """The store's ``wait``: until every key holds some value; raises on timeout."""
        self.store.wait([self.prefix + k for k in keys], timeout)

    def wait_get(self, key: str, timeout: timedelta, parse: Callable[[Any], T] = _identity) -> T:
        """Wait up to ``timeout`` for a *valid* value at ``key`` (a forged one is skipped).

        Raises:
            TimeoutError: no valid value within ``timeout``.
        """
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            left = deadline - time.monotonic()
            try:
                self.wait_exists([key], timedelta(seconds=max(left, 0.001)))
            except RuntimeError as exc:  # torch raises DistStoreError on timeout
                raise TimeoutError(f"no value at store key {self.prefix + key!r}: {exc}") from None
            value = self.get(key, parse)  # None: forged, or deleted since the wait
            if value is not None:
                return value
            if left <= 0:
                raise TimeoutError(f"no valid value at store key {self.prefix + key!r}")
            time.sleep(POLL_S)

    def first(self, key: str, value: object, parse: Callable[[Any], T] = _identity) -> T:
        """Set ``key`` to ``value`` unless a valid value is there; return the first valid one.

        A forged or junk value already at ``key`` is replaced (atomically, with compare-and-set),
        so a stranger who writes first cannot block the real writer.
        """
        mine = self.encode(key, value)
        expected = b""
        for _ in range(16):
            # The store takes bytes as well as str: junk need not be valid UTF-8.
            got = self.store.compare_set(self.prefix + key, expected, mine)  # type: ignore[arg-type]
            if got == mine.encode():
                return parse(value)
            found = self.accept(key, got, parse)
            if found is not None:
                return found
            expected = got
        raise TimeoutError(f"store key {self.prefix + key!r} keeps being overwritten")

    def supersede(self, key: str, old: bytes, value: object) -> bool:
        """Replace exactly the frame ``old`` (as read at ``key``) with ``value``, atomically;
        False when someone changed ``key`` first."""
        mine = self.encode(key, value)
        got = self.store.compare_set(self.prefix + key, old, mine)  # type: ignore[arg-type]
        return bool(got == mine.encode())

    def bump(self, key: str, amount: int) -> int:
        """Add ``amount`` to the *unsigned* counter at ``key`` and return its value.

        Anyone can move a counter, so use it only as a hint ("look again"), never as a fact.
        """
        return int(self.store.add(self.prefix + key, amount))

    def delete(self, key: str) -> None:
        """Delete ``key``; a store without deletion or an absent key is fine."""
        with contextlib.suppress(RuntimeError):
            self.store.delete_key(self.prefix + key)


def claimed(raw: bytes, field: str) -> str:
    """``field`` of the frame ``raw`` *without* verifying it: only for naming things in errors."""
    try:
        value = json.loads(raw.decode("utf-8", "replace").split(" ", 2)[2])
        return str(value[field]) if isinstance(value, dict) and field in value else "?"
    except (ValueError, IndexError, RecursionError):
        return "?"


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint in (str, bool):
        return isinstance(value, hint)
    if origin is not None:
        return isinstance(value, origin)
    return True


def as_record(cls: type[T], value: Any) -> T:
    """Build dataclass ``cls`` from a JSON object, checking field names and simple types.

    Raises:
        TypeError: not an object, unknown or missing fields, or a field of the wrong type.
    """
    if not isinstance(value, dict):
        raise TypeError(f"{cls.__name__} must be a JSON object, got {type(value).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(value) - names
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    for name, field_value in value.items():
        if not _type_ok(field_value, hints[name]):
            raise TypeError(f"{cls.__name__}.{name} has the wrong type: {field_value!r}")
    return cls(**value)
