"""Which rank writes which file of the replicated state.

The replicated state (model, optimizer, scheduler and objects outside ZeRO) is the same on
every rank under data parallelism, so any rank can write any part of it. As torch DCP does, the
ranks share the work: each section's tensors are split into at least one file per rank (parts
of at most ~64 MiB, ``sections.py``), and the files are dealt out largest first, each to the
rank with the fewest bytes so far (ties to the highest rank: rank 0 also writes the JSON files
and the manifest). Every rank computes the same deal from its own state.

The deal needs every rank to hold the same tensors under the same names, shapes and dtypes:
each rank hashes them (:func:`fingerprint`) and ``save`` compares the hashes in its opening
collective. Where they differ (different models per rank), or with ``save(...,
replicas_equal=False)``, rank 0 writes its own copy of all of it, as before. Equal *values* are
not checked (it would cost a pass over every byte): like DCP, a save of replicas that differ
in value mixes them; pass ``replicas_equal=False`` for such state.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from phalanx.checkpoint.sections import Section

__all__ = ["Share", "deal", "fingerprint", "share"]


@dataclass(frozen=True)
class Share:
    """The replicated files one rank writes."""

    tensor_files: list[tuple[str, Section]] = field(default_factory=list)
    """File name and the section it belongs to, cut down to the file's tensors."""
    indexes: list[tuple[str, bytes]] = field(default_factory=list)
    """The sections' JSON files (on rank 0)."""
    sections: list[str] = field(default_factory=list)
    """Every replicated section's name (for the manifest; on rank 0)."""


def fingerprint(sections: list[Section]) -> str:
    """A hash of the sections' names and their tensors' names, shapes and dtypes."""
    layout = [
        [s.name, [[k, str(t.dtype), list(t.shape)] for k, t in s.tensors.items()]] for s in sections
    ]
    return hashlib.sha256(json.dumps(layout).encode()).hexdigest()


def deal(sizes: list[tuple[str, int]], world: int) -> dict[str, int]:
    """File name -> the rank that writes it: largest first, to the least loaded rank."""
    load = [0] * world
    out = {}
    for name, size in sorted(sizes, key=lambda item: (-item[1], item[0])):
        rank = min(range(world), key=lambda r: (load[r], -r))
        out[name] = rank
        load[rank] += size
    return out


def share(sections: list[Section], rank: int, world: int) -> Share:
    """This rank's part of writing ``sections`` when ``world`` ranks share the work (1: all)."""
    files = {s.name: s.tensor_files(parts=world) for s in sections}
    sizes = [
        (name, sum(t.numel() * t.element_size() for t in tensors.values()))
        for parts in files.values()
        for name, tensors in parts.items()
    ]
    owner = deal(sizes, world)
    mine = [
        (name, Section(s.name, None, tensors))
        for s in sections
        for name, tensors in files[s.name].items()
        if owner[name] == rank
    ]
    if rank != 0:
        return Share(mine)
    indexes = [(f"{s.name}.json", s.index(list(files[s.name]))) for s in sections]
    return Share(mine, indexes, [s.name for s in sections])
