"""Clock offsets between ranks, NTP style: four timestamps, the shortest round trip, a line.

One exchange between a rank (the client) and rank 0 (the reference) gives four readings: the
client sends at ``t1`` (its clock), rank 0 receives at ``t2`` and answers at ``t3`` (rank 0's
clock), the client receives at ``t4`` (its clock). Whatever the two legs take, rank 0's clock
minus the client's is (Mills, RFC 5905, section 8)::

    offset = ((t2 - t1) + (t3 - t4)) / 2      rtt = (t4 - t1) - (t3 - t2)

and the true offset lies within ``rtt / 2`` of it: the error comes only from the legs being
unequal, and neither leg is longer than the round trip. Of several exchanges the one with the
shortest round trip is kept (:func:`best`): a descheduled process or a busy link only ever
lengthens a round trip.

A :class:`ClockModel` holds the samples of one rank taken over a run (at start-up and at each
re-measurement) and maps any local time to rank 0's time: the offset is interpolated linearly
between samples (clocks drift at a steady rate between two samples) and held constant before
the first and after the last.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["ClockModel", "ClockSample", "best", "ntp_sample"]


@dataclass(frozen=True)
class ClockSample:
    """One measurement of a rank's clock against rank 0's."""

    at: float
    """Local time of the exchange (the middle of its round trip)."""
    offset: float
    """Seconds to add to a local time to get rank 0's."""
    rtt: float
    """Round trip minus rank 0's turnaround; the offset is right within ``rtt / 2``."""

    @property
    def error(self) -> float:
        """The bound on this sample's error, seconds."""
        return self.rtt / 2


def ntp_sample(t1: float, t2: float, t3: float, t4: float) -> ClockSample:
    """The sample of one exchange (see the module's docstring for the four times)."""
    offset = ((t2 - t1) + (t3 - t4)) / 2
    rtt = max(0.0, (t4 - t1) - (t3 - t2))
    return ClockSample(at=(t1 + t4) / 2, offset=offset, rtt=rtt)


def best(samples: Iterable[ClockSample]) -> ClockSample:
    """The sample with the shortest round trip.

    Raises:
        ValueError: no samples.
    """
    chosen = min(samples, key=lambda s: s.rtt, default=None)
    if chosen is None:
        raise ValueError("best(): no clock samples")
    return chosen


class ClockModel:
    """Local time to rank 0's time for one rank, from its samples (none: the identity)."""

    def __init__(self, samples: Sequence[ClockSample] = ()) -> None:
        self.samples = sorted(samples, key=lambda s: s.at)
        self._at = [s.at for s in self.samples]

    def offset_at(self, t: float) -> float:
        """The offset at local time ``t``: interpolated between samples, held outside them."""
        s = self.samples
        if not s:
            return 0.0
        i = bisect.bisect_right(self._at, t)
        if i == 0:
            return s[0].offset
        if i == len(s):
            return s[-1].offset
        a, b = s[i - 1], s[i]
        span = b.at - a.at
        w = (t - a.at) / span if span > 0 else 1.0
        return a.offset + w * (b.offset - a.offset)

    def align(self, t: float) -> float:
        """Local time ``t`` on rank 0's clock."""
        return t + self.offset_at(t)

    @property
    def error(self) -> float:
        """The largest error bound of the samples (0 without samples: rank 0 itself)."""
        return max((s.error for s in self.samples), default=0.0)

    @property
    def drift(self) -> float:
        """The largest change of offset between two consecutive samples, seconds: how far a
        constant offset would have been wrong, and an upper bound on what interpolation
        between them can miss if the drift was not steady."""
        pairs = zip(self.samples, self.samples[1:])
        return max((abs(b.offset - a.offset) for a, b in pairs), default=0.0)
