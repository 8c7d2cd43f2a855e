"""``PHALANX_DEBUG=1`` / ``validate=True``: compare every collective across ranks before it runs.

Each rank writes a fingerprint (op, reduce op, shape, dtype, root, call site) under
``fp/<group>/<seq>/<rank>`` and reads everyone's; every rank raises the same
:class:`~phalanx.comm.errors.CollectiveMismatchError` instead of aborting or hanging. Call
sites are compared by the rule of :mod:`.pairing`: a rank whose call at n is another rank's
call at n + 1 skipped one (or the other made an extra one). That shows only at n + 1, so a
skipped collective paired with a call of the same signature is named at the next collective,
before it runs, with the call that was skipped and where each rank is; the results of the
wrongly paired one are already wrong. Differing sites that do not shift (the seeds' ``if rank
== 0: scatter(t, chunks, src=0) else: scatter(t, src=0)``) pass.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from phalanx.comm.errors import CollectiveMismatchError, CollectiveTimeoutError
from phalanx.comm.signed import SignedStore
from phalanx.diagnostics import fingerprint as fpr
from phalanx.diagnostics.pairing import first_mismatch
from phalanx.diagnostics.snapshot import parse_progress

__all__ = ["Validator"]

POLL = timedelta(seconds=1)
RETRY_S = 0.01


def _fingerprint(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict) or not isinstance(value.get("seq"), int):
        raise TypeError("a fingerprint is an object with an integer seq")
    return value


class Validator:
    """One rank's side of validation: publish, compare, remember the previous position."""

    def __init__(self, store: SignedStore, rank: int, timeout_s: float, sites: bool) -> None:
        self.store, self.rank, self.timeout_s = store, rank, timeout_s
        self.sites = sites
        """Compare call sites too (``PHALANX_CALL_SITES``, see :mod:`.pairing`)."""
        self._prev: dict[str, dict[int, dict[str, Any]]] = {}

    def check(self, name: str, ranks: list[int], seq: int, fp: dict[str, Any]) -> None:
        """Publish ``fp`` and wait for every rank's; raise on a mismatch or a skip."""
        keys = [self._key(name, seq, r) for r in ranks]
        self.store.put(keys[ranks.index(self.rank)], fp)
        start = time.monotonic()
        while True:
            try:
                self.store.wait_exists(keys, POLL)
                present = dict(zip(ranks, keys))
            except RuntimeError:  # not every rank has published yet (DistStoreError: timeout)
                present = {r: k for r, k in zip(ranks, keys) if self.store.exists([k])}
            seen = self._load(present)
            if fpr.mismatch(seen):
                raise CollectiveMismatchError(self._message(name, seq, seen))
            if len(seen) == len(ranks):
                break
            waited = time.monotonic() - start
            if waited >= self.timeout_s:
                missing = [r for r in ranks if r not in seen]
                where = self._progress_of(name, missing)
                raise CollectiveTimeoutError(_timeout(self.rank, fp, missing, waited, where))
            time.sleep(RETRY_S)  # a forged value sits where a rank's will be: read again
        skip = self._skip(name, seq, seen)
        if skip is not None:
            raise CollectiveMismatchError(skip)
        self._prev[name] = seen
        if seq > 1:  # everyone has read seq-1 once all of seq is published
            self.store.delete(self._key(name, seq - 1, self.rank))

    @staticmethod
    def _key(name: str, seq: int, rank: int) -> str:
        return f"fp/{name}/{seq}/{rank}"

    def _load(self, keys: dict[int, str]) -> dict[int, dict[str, Any]]:
        """The valid fingerprints at ``keys`` (which exist); forged ones are left out."""
        if not keys:
            return {}
        values = self.store.get_present(list(keys.values()), _fingerprint)
        return {r: v for r, v in zip(keys, values) if v is not None}

    def _progress_of(self, name: str, ranks: list[int]) -> str:
        """Where ``ranks`` are, from their last progress snapshots."""
        parts = []
        for r in ranks:
            try:
                seen = self.store.get(f"progress/{r}", parse_progress) or {}
            except Exception:
                return ""
            if name not in seen:
                parts.append(f"rank {r} reported no collective yet")
            else:
                parts.append(f"rank {r} last entered #{seen[name][0]} ({seen[name][1]})")
        return "; ".join(parts) + ". " if parts else ""

    def _skip(self, name: str, seq: int, seen: dict[int, dict[str, Any]]) -> str | None:
        prev = self._prev.get(name, {})
        if not self.sites or not prev:
            return None
        calls = {
            r: {seq - 1: fpr.as_record(prev[r]), seq: fpr.as_record(fp)}
            for r, fp in seen.items()
            if r in prev
        }
        div = first_mismatch(calls, name)
        if div is None or not div.skipped:
            return None
        return (
            f"[rank {self.rank}] {div.describe()}; stopped before collective #{seq} ran. "
            f"(PHALANX_DEBUG compares call sites; set PHALANX_CALL_SITES=0 if these calls are "
            f"meant to pair.)"
        )

    def _message(self, name: str, seq: int, seen: dict[int, dict[str, Any]]) -> str:
        skip = self._skip(name, seq, seen)
        return skip if skip is not None else fpr.mismatch_message(self.rank, name, seq, seen)


def _timeout(rank: int, fp: dict[str, Any], missing: list[int], waited: float, where: str) -> str:
    return (
        f"[rank {rank}] {fpr.describe(fp)} (collective #{fp['seq']} on group "
        f"{fp['group']}) timed out after {waited:.0f} s: rank(s) {missing} never reached it. "
        f"{where}Check those ranks' logs: they may have crashed, "
        f"hang in other code, or skipped this collective."
    )
