"""The always-on mismatch check: ranks compare their recent collective calls in the background.

:func:`~phalanx.diagnostics.tracking.enter` folds each call's signature (op, shape and dtype, reduce
op, root) into a rolling CRC per group (:meth:`Checker.note`, well under a microsecond). The
progress thread publishes, with its progress snapshot, per group ``[seq, last op, CRC at seq,
window]``, the window being the last ``WINDOW`` calls ``[seq, crc, op, shape, args, site]``.
Every tick (0.5 s) each rank reads the snapshots of its neighbours in each group (the ranks
before and after it) and compares the positions both hold: equal CRCs mean equal signature
sequences up to there; the windows name the first wrongly paired call
(:func:`~phalanx.diagnostics.pairing.first_mismatch`).

A signature mismatch is logged at once, published under ``mismatch`` (the first finding wins;
every rank reads it each tick, so non-neighbours learn it too) and raised as
:class:`~phalanx.comm.errors.CollectiveMismatchError` at this rank's next collective, or by the
failure report of the collective it is stuck in. A skip whose calls have equal signatures (only
the sites shift) is logged as a warning, not raised: rank-dependent call sites can be legitimate
(see :mod:`.pairing`), and the check must never stop a correct program.

Nothing is checked *before* a collective runs (that would cost a round trip per call): a shape
or dtype mismatch that gloo aborts on is named by the survivors' failure report from the dead
rank's call ring (:mod:`.call_ring`), a reduce-op mismatch that gloo completes silently is
raised at the next collective after the next tick.
"""

from __future__ import annotations

import bisect
import logging
import zlib
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from phalanx.comm.signed import SignedStore
from phalanx.diagnostics.flight import FlightRecorder, Record
from phalanx.diagnostics.pairing import Divergence, first_mismatch

__all__ = [
    "Checker",
    "Comparison",
    "compare",
    "neighbours",
    "window_from",
]

WINDOW = 32
HISTORY = 4096
log = logging.getLogger(__name__)


def _finding(value: Any) -> dict[str, Any]:
    if not (isinstance(value, dict) and isinstance(value.get("text"), str)):
        raise TypeError("a mismatch finding is {text}")
    return value


def window_from(entries: Any) -> dict[int, tuple[int, Record]]:
    """seq -> (crc, call) from a published window (malformed entries are skipped)."""
    out = {}
    for e in entries if isinstance(entries, list) else []:
        if isinstance(e, list) and len(e) == 6 and all(isinstance(x, int) for x in e[:2]):
            seq, crc, op, shape, args, site = e
            out[seq] = (crc, Record("", seq, str(op), str(shape), str(site), 0.0, args=str(args)))
    return out


def neighbours(rank: int, groups: list[list[int]]) -> list[int]:
    """The ranks before and after ``rank`` in each of its groups (ranks in group order)."""
    out: set[int] = set()
    for ranks in groups:
        if rank in ranks and len(ranks) > 1:
            i = ranks.index(rank)
            out.update({ranks[i - 1], ranks[(i + 1) % len(ranks)]})
    out.discard(rank)
    return sorted(out)


@dataclass(frozen=True)
class Comparison:
    """Two ranks' windows of one group, compared."""

    divergence: Divergence | None
    """The first wrongly paired call the windows show."""
    differing: int | None
    """The first common position whose CRCs differ (None: the signatures agree)."""
    start: int | None
    """The first common position (None: the windows do not overlap)."""


def compare(
    group: str,
    mine: Mapping[int, tuple[int, Record]],
    theirs: Mapping[int, tuple[int, Record]],
    ranks: tuple[int, int],
    sites: bool,
) -> Comparison:
    """Compare two ranks' windows of one group (pure).

    ``mine`` and ``theirs`` map seq -> (rolling CRC, call). The signatures differ when the CRCs
    differ at a common position, even if the windows are too short to show the call.
    """
    common = sorted(set(mine) & set(theirs))
    differing = next((s for s in common if mine[s][0] != theirs[s][0]), None)
    calls = {
        ranks[0]: {s: c for s, (_, c) in mine.items()},
        ranks[1]: {s: c for s, (_, c) in theirs.items()},
    }
    div = first_mismatch(calls, group, sites)
    return Comparison(div, differing, common[0] if common else None)


class Checker:
    """One rank's side of the check: the rolling CRCs, the windows, the finding."""

    def __init__(self, rank: int, sites: bool) -> None:
        self.rank, self.sites = rank, sites
        self.chain: dict[str, int] = {}
        self.history: dict[str, deque[tuple[int, int]]] = {}
        self.found: str | None = None
        """The mismatch this rank raises at its next collective (None: none found)."""
        self.finding: str | None = None
        """The finding's text without this rank's prefix."""
        self._warned: set[tuple[str, int]] = set()
        self.agreed: dict[str, int] = {}
        """Per group, the last position whose CRC matched a neighbour's."""

    def note(self, group: str, seq: int, op: str, shape: str, args: str) -> None:
        """Fold one call into its group's rolling CRC (the hot path)."""
        crc = zlib.crc32(f"{op}\0{shape}\0{args}".encode(), self.chain.get(group, 0))
        self.chain[group] = crc
        hist = self.history.get(group)
        if hist is None:
            hist = self.history[group] = deque(maxlen=HISTORY)
        hist.append((seq, crc))

    def windows(self, recorder: FlightRecorder) -> dict[str, dict[int, tuple[int, Record]]]:
        """Per group, this rank's last ``WINDOW`` calls with their CRCs."""
        out = {}
        for group, hist in list(self.history.items()):
            crcs = dict(list(hist)[-2 * WINDOW :])
            recs = recorder.tail(group, WINDOW)
            out[group] = {r.seq: (crcs[r.seq], r) for r in recs if r.seq in crcs}
        return out

    @staticmethod
    def published(window: Mapping[int, tuple[int, Record]]) -> list[list[Any]]:
        """A window as JSON for the progress snapshot."""
        return [[s, c, r.op, r.shape, r.args, r.site] for s, (c, r) in sorted(window.items())]

    def extend(self, snapshot: dict[str, list[Any]], recorder: FlightRecorder) -> None:
        """Add ``crc, window`` to each ``[seq, op]`` entry of a progress snapshot."""
        windows = self.windows(recorder)
        for group, entry in snapshot.items():
            crc = self.crc_at(group, entry[0])
            if crc is not None:
                entry += [crc, self.published(windows.get(group, {}))]

    def tick(
        self,
        store: SignedStore,
        snapshot: dict[str, list[Any]],
        peers: list[int],
        parse: Callable[[Any], dict[str, list[Any]]],
    ) -> None:
        """Adopt a published finding, or compare with ``peers``' published snapshots."""
        self.poll(store)
        if self.found is not None:
            return
        mine = {g: window_from(e[3]) for g, e in snapshot.items() if len(e) == 4}
        for peer in peers:
            theirs = store.get(f"progress/{peer}", parse)
            text = None if theirs is None else self.check(peer, theirs, mine)
            if text is not None:
                self.adopt(store, text, publish=True)
                return

    def crc_at(self, group: str, seq: int) -> int | None:
        """This rank's rolling CRC of ``group`` at ``seq`` (None: not reached, or forgotten)."""
        hist = list(self.history.get(group, ()))
        i = bisect.bisect_left(hist, (seq, -1))
        return hist[i][1] if i < len(hist) and hist[i][0] == seq else None

    def check(
        self,
        peer: int,
        snapshot: Mapping[str, list[Any]],
        mine: Mapping[str, Mapping[int, tuple[int, Record]]],
    ) -> str | None:
        """Compare ``peer``'s snapshot with this rank's windows; the finding's text, if any."""
        for group, entry in snapshot.items():
            if len(entry) < 4 or group not in mine or not isinstance(entry[2], int):
                continue
            seq, crc = entry[0], entry[2]
            own = self.crc_at(group, seq)
            cmp = compare(group, mine[group], window_from(entry[3]), (self.rank, peer), self.sites)
            if cmp.differing is not None or (own is not None and own != crc):
                return _text(group, seq, cmp, self.agreed.get(group, 0) + 1)
            if own is not None:
                self.agreed[group] = max(self.agreed.get(group, 0), seq)
            div = cmp.divergence
            if div is not None and div.skipped and (group, div.seq) not in self._warned:
                self._warned.add((group, div.seq))
                log.warning(
                    "rank %d: %s (if these call sites are meant to pair, set PHALANX_CALL_SITES=0)",
                    self.rank,
                    div.describe(),
                )
        return None

    def adopt(self, store: SignedStore, text: str, publish: bool) -> None:
        """Make ``text`` this rank's finding: log it once, and publish it if found here."""
        if self.found is not None:
            return
        if publish:
            text = store.first("mismatch", {"text": text}, _finding)["text"]
        self.finding = text
        self.found = (
            f"[rank {self.rank}] {text}. Found after the fact: from that collective on, results "
            f"are wrong or never come. This rank raises at its next collective; a collective it "
            f"is stuck in fails with this error when the backend gives up."
        )
        log.error("%s", self.found)

    def poll(self, store: SignedStore) -> None:
        """Adopt a finding another rank published."""
        if self.found is None:
            finding = store.get("mismatch", _finding)
            if finding is not None:
                self.adopt(store, finding["text"], publish=False)


def _text(group: str, seq: int, cmp: Comparison, low: int) -> str:
    div = cmp.divergence
    if div is None:
        return (
            f"phalanx mismatch check: the ranks' collective calls on group {group} differ "
            f"between #{low} and #{seq} (before the last {WINDOW} calls compared); run with "
            f"PHALANX_DEBUG=1 to stop at the first one"
        )
    text = f"phalanx mismatch check: {div.describe()}"
    if cmp.differing is not None and cmp.differing == cmp.start and low < cmp.start:
        text += (
            f" (the first difference lies between #{low} and #{cmp.differing}: the last "
            f"{WINDOW} calls compared start at #{cmp.start}; PHALANX_DEBUG=1 stops at it)"
        )
    return text
