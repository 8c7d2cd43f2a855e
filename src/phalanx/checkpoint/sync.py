"""Coordinating ranks around a checkpoint without long collectives.

Writing a large checkpoint on rank 0 can take longer than the collective timeout, so the ranks
must not wait for it inside a gloo/NCCL collective. One short broadcast at the start agrees on a
random token; from then on ranks talk through the rendezvous store under
``phalanx/checkpoint/<token>/``: each publishes its result (``set``) and waiters use
``store.wait`` with a long timeout (``PHALANX_CHECKPOINT_TIMEOUT`` seconds, default 1800). The
random token keeps keys of earlier saves and of earlier restart generations apart. Every value
is signed with the job secret (:mod:`phalanx.comm.signed`): a forged answer is skipped and the
wait goes on for the real one. Each rank says it is done under its own signed key
``closed/<rank>``; a rank that finds all of them deletes the session's keys (a shared counter
would let a stranger delete them under the ranks' feet).
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from phalanx.checkpoint.manifest import CheckpointError
from phalanx.comm.signed import SignedStore

__all__ = ["Session", "group_rank", "open_session", "set_peer_check"]

TIMEOUT_ENV = "PHALANX_CHECKPOINT_TIMEOUT"
CHECK_EVERY_S = 0.25
"""How often a waiting rank asks :func:`set_peer_check`'s function whether a peer is lost."""
_PEER_CHECK: Callable[[], None] | None = None


def set_peer_check(check: Callable[[], None] | None) -> None:
    """Let store waits give up early: ``check()`` raises when a peer of the job is lost.

    A live job (``phalanx.Job`` under ``--recovery live``) sets it, so that a checkpoint whose
    writer died fails within ``CHECK_EVERY_S`` and the job regroups, instead of waiting out
    ``PHALANX_CHECKPOINT_TIMEOUT``; None removes it.
    """
    global _PEER_CHECK
    _PEER_CHECK = check


_SHARED = ("committed", "tmpdir", "chosen")
_PER_RANK = ("written", "loaded", "closed")


def _timeout() -> timedelta:
    raw = os.environ.get(TIMEOUT_ENV, "1800")
    try:
        return timedelta(seconds=float(raw))
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None


@dataclass
class Session:
    """One save or load as seen by one rank: its rank, the group size and the store keys."""

    rank: int
    size: int
    token: str
    store: SignedStore | None = None
    agreed: bool = True
    """Whether every rank opened the session with the same fingerprint (see ``open_session``)."""

    def for_thread(self) -> Session:
        """This session over a connection of its own to the store, for a background thread.

        A thread that blocks in ``store.wait`` on the training thread's connection would hold
        that connection's lock, stalling every other store call of the process meanwhile.
        """
        if self.store is None:
            return self
        clone = getattr(self.store.store, "clone", None)
        return replace(self, store=self.store.over(clone()) if clone is not None else self.store)

    def _key(self, name: str) -> str:
        return f"phalanx/checkpoint/{self.token}/{name}"

    def publish(self, name: str, value: dict[str, Any]) -> None:
        """Set key ``name`` of this session to ``value`` (JSON, signed)."""
        if self.store is not None:
            self.store.put(self._key(name), value)

    def wait(
        self, name: str, parse: Callable[[dict[str, Any]], Any] = lambda v: v
    ) -> dict[str, Any]:
        """Wait (long timeout, no collective) for a valid value at key ``name``; return it.

        ``parse`` checks the shape of an ``ok`` answer (raising ValueError / TypeError /
        KeyError): a value it refuses, or a forged one, is skipped like an absent one.
        """
        assert self.store is not None
        limit = _timeout()
        deadline = time.monotonic() + limit.total_seconds()
        while True:
            left = deadline - time.monotonic()
            part = left if _PEER_CHECK is None else min(left, CHECK_EVERY_S)
            try:
                return self.store.wait_get(
                    self._key(name), timedelta(seconds=max(part, 0.001)), _answer(parse)
                )
            except TimeoutError as exc:
                if left > part:  # a slice ran out: ask whether a peer is lost, wait on
                    assert _PEER_CHECK is not None
                    _PEER_CHECK()
                    continue
                raise CheckpointError(
                    f"rank {self.rank}: gave up waiting for {name!r} of checkpoint "
                    f"session {self.token} after {limit} ({exc}); a peer "
                    f"died or is stuck (raise {TIMEOUT_ENV} for huge checkpoints)"
                ) from exc

    def share(self, name: str, compute: Callable[[], Any]) -> Any:
        """Rank 0 computes a plain value and every rank returns it (through the store).

        The others wait on the store with the long timeout, not in a collective, so ``compute``
        may take long (e.g. verifying checkpoints). An exception on rank 0 is re-raised there
        and becomes a :class:`CheckpointError` with its message on the other ranks.
        """
        if self.rank == 0:
            try:
                value = compute()
            except Exception as exc:
                self.publish(name, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
                raise
            self.publish(name, {"ok": True, "value": value})
            return value
        got = self.wait(name, lambda v: v["value"])
        if not got["ok"]:
            raise CheckpointError(f"rank 0 failed: {got['error']}")
        return got["value"]

    def close(self) -> None:
        """Say this rank is done; a rank that sees every rank done deletes the session's keys.

        Each rank writes ``closed/<rank>`` and then reads everyone's, so the last one to write
        sees them all (two may both delete, which is harmless; a key that vanishes while it is
        read means another rank saw them all).
        """
        if self.store is None:
            return
        self.publish(f"closed/{self.rank}", {"ok": True})
        keys = [self._key(f"closed/{r}") for r in range(self.size)]
        # One round trip while some rank is still open. Once all have closed, another rank may
        # be deleting the keys already, so they are read without blocking (a multi_get of a
        # deleted key waits out the store's whole timeout: a 4-rank job hung here).
        if self.store.exists(keys) and all(self.store.get(k) is not None for k in keys):
            names = [*_SHARED, *(f"{k}/{r}" for k in _PER_RANK for r in range(self.size))]
            for name in names:
                self.store.delete(self._key(name))


def _answer(parse: Callable[[dict[str, Any]], Any]) -> Callable[[Any], dict[str, Any]]:
    """A check of an answer's shape: ``{"ok": false, "error": "..."}`` or ``{"ok": true, ...}``.

    ``parse`` checks the rest of an ``ok`` answer.
    """

    def check(value: Any) -> dict[str, Any]:
        if not isinstance(value, dict) or not isinstance(value.get("ok"), bool):
            raise TypeError("an answer is an object with a boolean 'ok'")
        if not value["ok"] and not isinstance(value.get("error"), str):
            raise TypeError("a failed answer names its error")
        if value["ok"]:
            parse(value)
        return value

    return check


def group_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size ((0, 1) without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def open_session(group: dist.ProcessGroup | None, fingerprint: str | None = None) -> Session:
    """Start a save/load on every rank of ``group`` (one short collective: a random token).

    Args:
        group: The process group (None: the default group, or a single process when
            torch.distributed is not initialised).
        fingerprint: A string every rank gives; the ranks then gather them instead of only
            broadcasting the token, and ``Session.agreed`` says whether they were all equal.
    """
    token = secrets.token_hex(6)
    rank, size = group_rank(group)
    if size == 1:
        return Session(rank, 1, token)
    from phalanx.comm.objects import all_gather_object, broadcast_object_list

    agreed = True
    if fingerprint is None:
        chosen = [token]
        root = 0 if group is None else dist.get_global_rank(group, 0)
        broadcast_object_list(chosen, src=root, group=group)
        token = chosen[0]
    else:
        gathered: list[Any] = [None] * size
        all_gather_object(gathered, [token, fingerprint], group=group)
        token = gathered[0][0]
        agreed = all(g[1] == gathered[0][1] for g in gathered)
    from phalanx.comm.group import signed_store

    return Session(rank, size, str(token), signed_store(), agreed)
