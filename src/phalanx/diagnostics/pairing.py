"""Which collective calls the ranks paired wrongly: the one rule behind every mismatch report.

Ranks pair collectives by position: the n-th call on a group meets the n-th call of every
other rank. :func:`first_mismatch` (pure) finds the first position that is *wrong*:

- the calls differ in signature (op, shape and dtype, reduce op, root): gloo aborts, hangs or
  returns wrong numbers; or
- one rank is a call ahead: its call at n has the site and signature of the call another
  rank makes at n + 1, while their sites at n differ. That is a skipped (or extra) collective
  paired with a call of the same signature, whose results are silently wrong.

Different call sites alone are *not* wrong: the seeds' ``if rank == 0: dist.scatter(t, chunks,
src=0) else: dist.scatter(t, src=0)`` pairs two lines legitimately, and so does any helper a
rank reaches by another path. Only the shift to the other rank's *next* call marks a skip, so
a skip is named when the next collective shows it (``PHALANX_CALL_SITES=0`` turns the site
rule off). A position some ranks have not reached yet is never wrong: ranks at different
steps have not diverged.

:func:`first_divergence` lines up several ranks' flight records (:mod:`.flight`) by group and
sequence number and applies the rule to each group: what ``phalanx diagnose`` and the hang
report name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from phalanx.comm.flags import sites_compared
from phalanx.diagnostics.flight import Record

__all__ = ["Divergence", "first_divergence", "first_mismatch"]


def signature(rec: Record) -> tuple[str, str, str]:
    """What must agree across ranks: op, shape and dtype, reduce op and root."""
    return rec.op, rec.shape, rec.args


def _differing(calls: list[Record]) -> list[str]:
    names = ("op", "shape", "args")
    out = [n for n in names if len({getattr(c, n) for c in calls}) > 1]
    return ["shape/dtype" if n == "shape" else "reduce op/root" if n == "args" else n for n in out]


def _ranks(ranks: list[int] | tuple[int, ...]) -> str:
    return f"rank(s) {list(ranks)}"


@dataclass(frozen=True)
class Divergence:
    """The first wrongly paired collective of a group."""

    group: str
    seq: int
    issued: dict[int, Record]
    """Rank -> what it issued at that position."""
    ahead: tuple[int, ...] = ()
    """Ranks one call ahead (empty when the signatures differ)."""
    following: dict[int, Record] = field(default_factory=dict)
    """For a skip: what the other ranks issued next, at ``seq + 1``."""

    @property
    def skipped(self) -> bool:
        """True for a skipped (or extra) collective rather than differing signatures."""
        return bool(self.ahead)

    def by_call(self) -> dict[str, list[int]]:
        """``where()`` of each distinct call -> the ranks that issued it."""
        out: dict[str, list[int]] = {}
        for rank, rec in sorted(self.issued.items()):
            out.setdefault(rec.where(), []).append(rank)
        return out

    def describe(self) -> str:
        """Which ranks did what, with call sites, and what follows for the results."""
        head = f"collective #{self.seq} on group {self.group} diverges"
        calls = "; ".join(f"{_ranks(r)} issued {w}" for w, r in self.by_call().items())
        if not self.skipped:
            fields = ", ".join(_differing(list(self.issued.values())))
            return f"{head}: {calls} (differing: {fields})"
        behind = sorted(self.following)
        skipped = self.issued[behind[0]].where()
        return (
            f"{head}: {calls}. {_ranks(self.ahead)} issued there what "
            f"{_ranks(behind)} issued next (#{self.seq + 1}): {_ranks(self.ahead)} skipped "
            f"{skipped}, or {_ranks(behind)} made an extra call. The results of #{self.seq} "
            f"are wrong"
        )


def _one_ahead(at: dict[int, Record], nxt: Mapping[int, Record | None]) -> tuple[int, ...]:
    """Ranks whose call is another rank's next call, from a different site than that rank's."""
    ahead = set()
    for b, call in at.items():
        for a, mine in at.items():
            then = nxt.get(a)
            if mine.site == call.site or then is None or "?" in (mine.site, call.site):
                continue
            if then.site == call.site and signature(then) == signature(call):
                ahead.add(b)
    return tuple(sorted(ahead))


def first_mismatch(
    calls: Mapping[int, Mapping[int, Record]], group: str, sites: bool = True
) -> Divergence | None:
    """The first wrongly paired position of one group; None when every common one is right.

    Args:
        calls: rank -> seq -> that rank's call at that position (any window of its calls).
        group: The group's name, for the report.
        sites: Apply the skipped-collective rule (needs the call sites).
    """
    members = {r: c for r, c in calls.items() if c}
    if len(members) < 2:
        return None
    low = max(min(c) for c in members.values())
    high = min(max(c) for c in members.values())
    for seq in range(low, high + 1):
        at = {r: c[seq] for r, c in members.items() if seq in c}
        if len(at) < len(members):
            continue  # a gap in some rank's window: nothing to say about this position
        if len({signature(r) for r in at.values()}) > 1:
            return Divergence(group, seq, at)
        if sites and len({r.site for r in at.values()}) > 1:
            nxt = {r: c.get(seq + 1) for r, c in members.items()}
            ahead = _one_ahead(at, nxt)
            if ahead:
                following = {r: n for r, n in nxt.items() if r not in ahead and n is not None}
                return Divergence(group, seq, at, ahead, following)
    return None


def first_divergence(records: Mapping[int, Sequence[Record]]) -> Divergence | None:
    """The first collective the ranks paired wrongly (:func:`first_mismatch` per group); else None.

    Only positions every rank still holds are compared (a ring forgets its oldest records,
    and a rank at an earlier step has not reached the later ones). Among groups, the
    divergence that started earliest in time is returned. Point-to-point records are left
    out: a send and its receive differ by design.
    """
    sites = sites_compared()
    records = {rank: [r for r in recs if r.peer is None] for rank, recs in records.items()}
    found: list[tuple[float, Divergence]] = []
    for group in sorted({r.group for recs in records.values() for r in recs}):
        calls = {
            rank: {r.seq: r for r in recs if r.group == group} for rank, recs in records.items()
        }
        div = first_mismatch(calls, group, sites)
        if div is not None:
            found.append((min(r.start for r in div.issued.values()), div))
    return min(found, key=lambda f: f[0])[1] if found else None
