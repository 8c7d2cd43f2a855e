"""The text of a hang report, from every rank's answer to one incident (pure).

One rank (the incident's opener) builds it and publishes it; every rank prints exactly that
text, so nothing in it depends on who prints it or when: each "waited" is measured on the
clock of the rank that waited, at the moment it answered.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from phalanx.diagnostics.flight import Record
from phalanx.diagnostics.pairing import first_divergence

__all__ = ["Answer", "Incident", "Silent", "build_report"]

MAX_STACKS = 8
ALSO_S = 1.0
"""Another rank's wait is listed once it is this long (shorter ones are ordinary traffic)."""


@dataclass(frozen=True)
class Incident:
    """A hang as its opener saw it."""

    n: int
    opener: int
    at: float
    """The opener's ``time.time()`` when it opened the incident."""
    stuck: Record
    """The opener's collective that waited too long."""


@dataclass(frozen=True)
class Answer:
    """One rank's answer: when, what it waits in, its main thread, its last calls."""

    at: float
    in_flight: Record | None
    stack: list[str]
    """``traceback.format_stack`` lines (most recent call last)."""
    records: list[Record]
    host: str = ""
    """Its host name ("" when it did not say)."""


@dataclass(frozen=True)
class Silent:
    """A rank that did not answer, with what its files and process say."""

    lines: list[str]
    calls: list[Record] | None = None
    """Its last calls from its ring file (None: not readable from the opener's host)."""
    stack: list[str] = field(default_factory=list)
    """Its main thread from a faulthandler dump (most recent call first), if any."""
    elsewhere: tuple[str, str] | None = None
    """``(host name, address)`` of the other machine it runs on (address "" when it did not
    say); None when it runs on the reporter's machine, or nobody knows where."""


def _waiting(rank: int, rec: Record, at: float) -> str:
    kind = "collective" if rec.peer is None else "point-to-point operation"
    return (
        f"rank {rank} has waited {at - rec.start:.1f} s in {rec.where()} "
        f"({kind} #{rec.seq} on group {rec.group})"
    )


def _reached(records: list[Record], stuck: Record) -> bool:
    return any(x.group == stuck.group and x.seq >= stuck.seq for x in records)


def _last_done(records: list[Record], peer_of: int | None = None) -> str:
    """The last completed collective (with ``peer_of``: operation with that rank)."""
    done = [x for x in records if x.end is not None and x.peer == peer_of]
    return "none" if not done else f"{done[-1].where()} (#{done[-1].seq})"


def _stacks(ranks: list[int], answers: dict[int, Answer]) -> list[str]:
    """Main-thread stacks of ``ranks``, one block per distinct stack."""
    by_text: dict[str, list[int]] = {}
    for r in ranks:
        if r in answers:
            by_text.setdefault("".join(answers[r].stack), []).append(r)
    lines = []
    for text, who in list(by_text.items())[:MAX_STACKS]:
        name = f"rank {who[0]}" if len(who) == 1 else f"ranks {who}"
        lines.append(f"{name} main thread stack (most recent call last):")
        lines.extend("  " + ln.rstrip() for ln in text.splitlines())
    if len(by_text) > MAX_STACKS:
        lines.append(f"({len(by_text) - MAX_STACKS} more distinct stacks left out)")
    return lines


def _behind(
    inc: Incident, records: dict[int, list[Record]], lines: list[str]
) -> tuple[list[int], str, int | None]:
    """The ranks that hold the stuck operation up, said in ``lines``; what their last is."""
    stuck = inc.stuck
    if stuck.peer is None:
        behind = sorted(r for r, recs in records.items() if not _reached(recs, stuck))
        if behind:
            lines.append(f"Rank(s) {behind} never reached it.")
        return behind, "collective", None
    # a send or receive: the peer never posted the matching one
    them = set(records) if stuck.peer < 0 else {stuck.peer}
    behind = sorted(r for r in them if r != inc.opener)
    lines.append(f"It waits for rank(s) {behind} to post the matching operation.")
    return behind, f"operation with rank {inc.opener}", inc.opener


def _cut_off(answers: dict[int, Answer], silent: dict[int, Silent]) -> list[str]:
    """The other machines none of whose ranks answered: the network to them may be down.

    A rank that answered reached the store from its machine, so a machine with one such rank
    is not cut off; one whose every known rank is silent may be (its ranks cannot answer
    through a link that carries nothing), as well as its ranks being dead or stuck.
    """
    answered = {a.host for a in answers.values() if a.host}
    hosts: dict[tuple[str, str], list[int]] = {}
    for r, s in sorted(silent.items()):
        if s.elsewhere is not None and s.elsewhere[0] not in answered:
            hosts.setdefault(s.elsewhere, []).append(r)
    lines = []
    for (host, addr), ranks in hosts.items():
        label = f"{host} ({addr})" if addr else host
        lines.append(
            f"No rank on host {label} answered (rank(s) {ranks}, on another machine than the "
            f"reporting rank): the network link to {host} may be down or partitioned, besides "
            f"those ranks being dead or stuck; check that this machine reaches {addr or host} "
            f"and that they still run."
        )
    return lines


def build_report(inc: Incident, answers: dict[int, Answer], silent: dict[int, Silent]) -> str:
    """The report of incident ``inc``: who waits where, who is behind, why, their stacks."""
    stuck = inc.stuck
    lines = [f"phalanx hang report #{inc.n} (opened by rank {inc.opener}): "]
    lines[0] += _waiting(inc.opener, stuck, inc.at) + "."
    also = [
        _waiting(r, a.in_flight, a.at)
        for r, a in sorted(answers.items())
        if r != inc.opener and a.in_flight is not None and a.at - a.in_flight.start >= ALSO_S
    ]
    if also:
        lines.append("Also waiting: " + "; ".join(also) + ".")
    records = {r: a.records for r, a in answers.items()}
    records.update({r: s.calls for r, s in silent.items() if s.calls is not None})
    behind, what, peer_of = _behind(inc, records, lines)
    div = first_divergence(records)
    if div is not None:
        lines.append("First divergence: " + div.describe() + ".")
    lines.extend(_cut_off(answers, silent))
    for r in behind:
        if r in answers:
            lines.append(f"rank {r}: last completed {what}: {_last_done(records[r], peer_of)}")
    involved = sorted(set(behind) | (set(div.issued) if div is not None else set()))
    lines.extend(_stacks(involved or [inc.opener], answers))
    for r, s in sorted(silent.items()):
        lines.extend(s.lines)
        if s.calls is not None:
            lines.append(f"rank {r}: last completed collective: {_last_done(s.calls)}")
        if s.stack:
            lines.append(f"rank {r} main thread (faulthandler, most recent call first):")
            lines.extend("  " + ln for ln in s.stack)
    return "\n".join(lines)
