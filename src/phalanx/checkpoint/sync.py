"""Coordinating ranks around a checkpoint without long collectives.

Writing a large checkpoint on rank 0 can take longer than the collective timeout, so the ranks
must not wait for it inside a gloo/NCCL collective. One short broadcast at the start agrees on a
random token; from then on ranks talk through the rendezvous store under
``phalanx/checkpoint/<token>/``: each publishes its result (``set``) and waiters use
``store.wait`` with a long timeout (``PHALANX_CHECKPOINT_TIMEOUT`` seconds, default 1800). The
random token keeps keys of earlier saves and of earlier restart generations apart; the last rank
to finish deletes the session's keys.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from phalanx.checkpoint.manifest import CheckpointError

__all__ = ["Session", "open_session"]

TIMEOUT_ENV = "PHALANX_CHECKPOINT_TIMEOUT"
_SHARED = ("done", "committed", "tmpdir", "chosen")


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
    store: dist.Store | None = None

    def _key(self, name: str) -> str:
        return f"phalanx/checkpoint/{self.token}/{name}"

    def publish(self, name: str, value: dict[str, Any]) -> None:
        """Set key ``name`` of this session to ``value`` (JSON)."""
        if self.store is not None:
            self.store.set(self._key(name), json.dumps(value))

    def wait(self, name: str) -> dict[str, Any]:
        """Wait (long timeout, no collective) for key ``name`` and return its value."""
        assert self.store is not None
        key = self._key(name)
        try:
            self.store.wait([key], _timeout())
        except Exception as exc:
            raise CheckpointError(
                f"rank {self.rank}: gave up waiting for {name!r} of checkpoint "
                f"session {self.token} after {_timeout()} ({exc}); a peer "
                f"died or is stuck (raise {TIMEOUT_ENV} for huge checkpoints)"
            ) from exc
        value = json.loads(self.store.get(key))
        assert isinstance(value, dict)
        return value

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
        got = self.wait(name)
        if not got["ok"]:
            raise CheckpointError(f"rank 0 failed: {got['error']}")
        return got["value"]

    def close(self) -> None:
        """Count this rank out; the last rank out deletes the session's keys."""
        if self.store is None:
            return
        if self.store.add(self._key("done"), 1) == self.size:
            ranks = range(self.size)
            names = [*_SHARED, *(f"written/{r}" for r in ranks), *(f"loaded/{r}" for r in ranks)]
            for name in names:
                # An absent key, or a store without deletion, is fine.
                with contextlib.suppress(Exception):
                    self.store.delete_key(self._key(name))


def open_session(group: dist.ProcessGroup | None) -> Session:
    """Start a save/load on every rank of ``group`` (one short broadcast of a random token).

    Args:
        group: The process group (None: the default group, or a single process when
            torch.distributed is not initialised).
    """
    token = secrets.token_hex(6)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(group) if distributed else 0
    size = dist.get_world_size(group) if distributed else 1
    if size == 1:
        return Session(rank, 1, token)
    from phalanx.comm.objects import broadcast_object_list

    agreed = [token]
    root = 0 if group is None else dist.get_global_rank(group, 0)
    broadcast_object_list(agreed, src=root, group=group)
    return Session(rank, size, str(agreed[0]), dist.distributed_c10d._get_default_store())
