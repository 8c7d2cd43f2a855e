"""Who is in a generation: members, their order, and the pure rules that decide membership.

A *member* is a worker slot (``"<node_rank>.<local_rank>"``, stable across replacements) at one
*incarnation* (0 for the slot's first process, n for its n-th replacement). A generation's
membership is a list of members sorted by slot, so a replacement gets its slot's old rank back
whenever the world size is restored. Everything here is pure: no store, no process group.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Member", "admissible", "parse_members", "slot_order", "survivors"]


@dataclass(frozen=True, order=False)
class Member:
    """One process: a worker slot at one incarnation."""

    member_id: str
    """The slot's stable id (``PHALANX_MEMBER_ID``)."""
    incarnation: int
    """0 for the slot's first process, n for its n-th replacement."""

    def to_json(self) -> list[object]:
        """``[member_id, incarnation]``: the form stored in the membership lists."""
        return [self.member_id, self.incarnation]

    def __str__(self) -> str:
        return f"{self.member_id}#{self.incarnation}"


def slot_order(member_id: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key of a slot id: numeric parts compare as numbers ("0.10" after "0.9")."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in member_id.split("."))


def sort_members(members: Iterable[Member]) -> list[Member]:
    """``members`` in rank order: by slot, then incarnation."""
    return sorted(members, key=lambda m: (slot_order(m.member_id), m.incarnation))


def parse_members(value: Any) -> list[Member]:
    """A membership list read from the store (``[[id, incarnation], ...]``), checked.

    Raises:
        TypeError: not a list of ``[str, int]`` pairs, or a slot listed twice.
    """
    if not isinstance(value, list):
        raise TypeError(f"a membership must be a list, got {type(value).__name__}")
    members = []
    for item in value:
        ok = isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
        if not ok or not isinstance(item[1], int) or isinstance(item[1], bool) or item[1] < 0:
            raise TypeError(f"a member must be [slot id, incarnation >= 0], got {item!r}")
        members.append(Member(item[0], item[1]))
    if len({m.member_id for m in members}) != len(members):
        raise TypeError(f"a membership lists a slot twice: {value!r}")
    return members


def is_dead(member: Member, dead: Mapping[str, int]) -> bool:
    """True when the death record of ``member``'s slot covers its incarnation."""
    died = dead.get(member.member_id)
    return died is not None and died >= member.incarnation


def survivors(
    base: Sequence[Member], here: Iterable[Member], dead: Mapping[str, int]
) -> list[Member]:
    """The next membership after a failure: members of ``base`` that arrived and are not dead."""
    arrived = set(here)
    return sort_members(m for m in base if m in arrived and not is_dead(m, dead))


def admissible(
    members: Sequence[Member], joiners: Iterable[Member], dead: Mapping[str, int]
) -> tuple[list[Member], list[Member]]:
    """Split waiting ``joiners`` into (admit now, keep waiting); stale ones are dropped.

    A joiner is stale when its slot is already present at the same or a later incarnation, or
    its own incarnation is recorded dead. It must keep waiting while an older incarnation of its
    slot is still a member (that one died, but the survivors have not recovered from it yet).
    Of several joiners for one slot only the latest incarnation counts.
    """
    present = {m.member_id: m.incarnation for m in members}
    latest: dict[str, Member] = {}
    for j in joiners:
        if j.member_id not in latest or latest[j.member_id].incarnation < j.incarnation:
            latest[j.member_id] = j
    admit: list[Member] = []
    wait: list[Member] = []
    for j in latest.values():
        if is_dead(j, dead) or present.get(j.member_id, -1) >= j.incarnation:
            continue
        (wait if j.member_id in present else admit).append(j)
    return sort_members(admit), sort_members(wait)
