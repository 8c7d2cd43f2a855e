"""Rounds that do not wait for a late replica: ``late_policy="weighted"``.

With ``late_policy="wait"`` (the default) every replica synchronises after exactly H inner
steps, so a replica 4x slower holds the others at every all-reduce for H of its steps less H
of theirs: each round stalls by the slow replica's whole lag.

With ``"weighted"`` a round ends when the *first* replica has taken H inner steps:

1. That replica announces the round (one key per round in the job's c10d store, under the
   job's signed prefix) and enters the round's exchange.
2. Every other replica checks the key after each of its inner steps (one non-blocking store
   round trip, :attr:`.SyncStats.check_seconds`) and joins the exchange at its next step
   boundary, however many steps it took (>= 1). The others therefore wait at most one inner
   step of the slowest replica per round.
3. The exchange is one all-gather of every replica's inner steps this round; every rank gets
   the same counts, so every rank computes the same weighted average (weights
   ``steps_r / sum(steps)``: LocalSGD's parameters, DiLoCo's pseudo-gradient), bitwise equal
   on every rank. When all counts are equal the plain average runs, exactly as with
   ``"wait"``: without a late replica nothing changes.

The announcement is only a hint: a replica that joins because of it, or one that reaches H,
meets the others in the same exchange, whose counts alone decide the weights.

End of training: a replica that has read its data calls :meth:`~.PeriodicSync.flush` (or the
job's end, :meth:`~.PeriodicSync.finish`) and keeps joining the others' rounds with weight 0
until every replica is done; the last exchange averages what is left (a flush). Between
rounds it waits on the store for the next announcement (made by a replica reaching H, or by
the last replica to finish), not inside a collective, so a long tail does not look like a
hung collective. A late replica reads every one of its samples once, later than the others;
their end waits for it.

Why "wait" stays the default: with "weighted" the result depends on timing (which replica
took how many steps each round), the ranks are out of step between rounds (no collectives of
the loop's own there, saves only at a round's end), and with a fixed shard per rank the run
still ends when the late replica has read its data. What "weighted" buys is bounded stalls:
the others' rounds go on, and where the slowness moves between replicas the run is shorter
(measured in docs/async.md).
"""

from __future__ import annotations

import secrets
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from phalanx.comm import collectives as C
from phalanx.comm.group import signed_store
from phalanx.comm.signed import SignedStore

__all__ = ["LATE_POLICIES", "LateRounds", "weights_of"]

LATE_POLICIES = ("wait", "weighted")
"""``"wait"``: every replica syncs after exactly H steps; ``"weighted"``: this module."""

ROUND_TIMEOUT = timedelta(minutes=30)
"""How long a finished replica waits for the next round's announcement (c10d's default
collective timeout: one round is at most H inner steps of the slowest replica)."""


def weights_of(counts: list[int]) -> list[float] | None:
    """Each replica's weight ``steps / total``; None when the counts are equal (the plain
    average) or all 0 (nothing to synchronise: the caller skips)."""
    total = sum(counts)
    if len(set(counts)) == 1 or total == 0:
        return None
    return [c / total for c in counts]


class LateRounds:
    """The announcements and step-count exchange of one replica-synchronising algorithm.

    Args:
        group: The replicas' process group (None: every rank).
        store: Where rounds are announced (None: the default group's signed store).
    """

    def __init__(self, group: dist.ProcessGroup | None, store: SignedStore | None = None) -> None:
        store = store if store is not None else signed_store()
        if store is None:
            raise ValueError("late_policy='weighted' needs an initialised process group")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.store = store.sub(f"local_sgd/late/{self._agree_on_instance()}/")
        self.round = 0
        """Rounds exchanged so far (checkpointed: the same on every rank at a round's end)."""
        self.history: list[tuple[int, ...]] = []
        """Every exchange's counts, in round order (equal on every rank)."""
        self.drained = False
        self.check_seconds = 0.0
        """Seconds spent checking for announcements."""
        self.checks = 0

    def _agree_on_instance(self) -> int:
        """A random number of group rank 0's: this object's keys, the same on every rank and
        apart from any earlier job's in the same store (collective)."""
        mine = torch.tensor([secrets.randbits(62)], dtype=torch.int64)
        root = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        C.broadcast(mine, root, self.group)
        return int(mine[0])

    def _key(self) -> str:
        return f"round/{self.round}"

    def announced(self) -> bool:
        """True once some replica announced the current round (one store round trip)."""
        start = time.perf_counter()
        seen = self.store.exists([self._key()])
        self.check_seconds += time.perf_counter() - start
        self.checks += 1
        return seen

    def announce(self) -> None:
        """Tell the others this round ends now."""
        self.store.bump(self._key(), 1)

    def finished(self) -> None:
        """This replica took its last step: count it; the last one to finish announces."""
        if self.store.bump("done", 1) == self.world:
            self.announce()

    def wait_announced(self, timeout: timedelta = ROUND_TIMEOUT) -> None:
        """Block until the current round is announced (a finished replica between rounds)."""
        self.store.wait_exists([self._key()], timeout)

    def exchange(self, steps: int, done: bool) -> tuple[list[int], bool]:
        """Every replica's inner steps this round and whether all are done (collective)."""
        mine = torch.tensor([steps, int(done)], dtype=torch.int64)
        out = torch.empty(2 * self.world, dtype=torch.int64)
        C.all_gather_into_tensor(out, mine, self.group)
        all_done = bool(out[1::2].all())
        if self.rank == 0:  # every replica has left the round's checks
            self.store.delete(self._key())
            if all_done:
                self.store.delete("done")
        self.round += 1
        counts = out[0::2].tolist()
        self.history.append(tuple(counts))
        return counts, all_done
