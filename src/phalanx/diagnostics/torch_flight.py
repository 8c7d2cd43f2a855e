"""torch's Flight Recorder dumps, read as phalanx :class:`~phalanx.diagnostics.flight.Record` s.

torch 2.13 keeps its own ring of collectives when ``TORCH_FR_BUFFER_SIZE`` (or the older
``TORCH_NCCL_TRACE_BUFFER_SIZE``) is > 0, for gloo and NCCL alike. Each entry has the process
group (``process_group``: name, description), a per-group ``collective_seq_id`` (point-to-point
ops count in ``p2p_seq_id`` instead), the op (``profiling_name``, ``"gloo:all_reduce"``,
``"nccl:all_reduce"``), input and output sizes and dtypes, ``state`` (scheduled / started /
completed), the creation and completion times in ns, and the Python stack (``frames``,
innermost first). A rank's dump is ``torch._C._distributed_c10d._dump_fr_trace()`` (a pickle,
with frames) or ``_dump_fr_trace_json()`` (JSON, without frames). torch's documentation says
NCCL writes the pickle itself on a watchdog timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT=1``) to
``<prefix><rank>``, the prefix from ``TORCH_FR_DUMP_TEMP_FILE`` /
``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` (not measured here: no GPU). Measured with gloo on torch
2.13: the dump API works, but nothing is written on a timeout, send / recv are not recorded,
every entry stays "scheduled" and a timed-out collective is "retired" like a completed one, and
neither the reduce op nor the root is recorded.

This module turns such a dump into records, so ``phalanx diagnose`` gives a torch job (one that
never calls phalanx, NCCL included) the same first-divergence analysis as phalanx's own ring:
group ``torch pg <name>``, the collective sequence number, the op without its backend prefix,
the shapes and dtypes every rank passes, and the call site (the first frame outside torch).
Pickles are read by :mod:`.plain_pickle`, which never runs code from the file.

What phalanx's own recorder adds, and why it stays: it is always on, on every backend (torch's
is off unless the variable is set); it knows when each collective completed, through ``wait()``,
futures or polling, which gloo's entries do not say; and it is read live, so a hang is reported
while the ranks are alive, not from files afterwards. The overlap (a ring of op, shape and call
site per collective) is what those reports need. phalanx writes no dumps in torch's format and
no dump on an NCCL timeout: torch has both. With both recorders on, ``phalanx diagnose`` reads
both (see :mod:`.dumps`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from phalanx.diagnostics.flight import Record
from phalanx.diagnostics.plain_pickle import loads_plain

__all__ = [
    "TorchDump",
    "looks_like_torch_dump",
    "merge_sites",
    "read_torch_dump",
    "records_from_torch",
]

_DTYPES = {
    "Float": "float32",
    "Double": "float64",
    "Half": "float16",
    "BFloat16": "bfloat16",
    "Long": "int64",
    "Int": "int32",
    "Short": "int16",
    "Char": "int8",
    "Byte": "uint8",
    "Bool": "bool",
    "ComplexFloat": "complex64",
    "ComplexDouble": "complex128",
}
"""c10 ScalarType names, as the dump spells them -> torch dtype names, as phalanx records them."""
_RANK_IN_NAME = re.compile(r"(\d+)(\.[A-Za-z]+)?$")
_C_SOURCES = (".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp")
_LIBRARY_FILE = re.compile(r"(^|/)(torch|phalanx/comm)/")
"""torch's frames, and phalanx's collectives over torch (as phalanx's own records skip them)."""


class TorchDump:
    """One rank's torch Flight Recorder dump, as records."""

    def __init__(
        self, path: Path, rank: int, records: list[Record], has_frames: bool, backends: set[str]
    ) -> None:
        self.path = path
        self.rank = rank
        self.records = records
        self.has_frames = has_frames
        """False for the JSON form (or a dump taken without stack traces): no call sites."""
        self.backends = backends
        """The backends named in the entries' ``profiling_name`` (``gloo``, ``nccl``)."""


def looks_like_torch_dump(path: Path, head: bytes) -> bool:
    """Whether ``path`` (whose first bytes are ``head``) may be a torch dump: its name ends in a
    rank number, as torch names them, and it starts as a pickle or a JSON object does."""
    return bool(_RANK_IN_NAME.search(path.name)) and head[:1] in (b"\x80", b"{")


def read_torch_dump(path: Path) -> TorchDump:
    """Read one rank's dump (pickle or JSON), its rank from the file name (``<prefix><rank>``).

    Raises:
        ValueError: naming the file, when its name has no rank, when it is neither a plain-data
            pickle nor JSON, or when it is not a Flight Recorder dump.
    """
    match = _RANK_IN_NAME.search(path.name)
    if match is None:
        raise ValueError(
            f"{path}: no rank number at the end of the file name; torch names its dumps "
            "<prefix><rank> (TORCH_FR_DUMP_TEMP_FILE); rename the file so that it ends in its rank"
        )
    data = path.read_bytes()
    doc = _parse(data, str(path))
    if not isinstance(doc, dict) or not ("entries" in doc or "pg_config" in doc):
        raise ValueError(f"{path}: not a torch Flight Recorder dump (no 'entries' or 'pg_config')")
    entries = doc.get("entries", [])  # the JSON form leaves out an empty list
    records = records_from_torch(entries, str(path))
    has_frames = all(isinstance(e, dict) and "frames" in e for e in entries)
    backends = {str(e.get("profiling_name", "")).split(":")[0] for e in entries}
    return TorchDump(path, int(match.group(1)), records, has_frames, backends)


def _parse(data: bytes, source: str) -> object:
    if data[:1] == b"{":
        try:
            return json.loads(data)
        except ValueError as exc:
            raise ValueError(f"{source}: not valid JSON ({exc})") from None
    return loads_plain(data, source)


def records_from_torch(entries: object, source: str = "<dump>") -> list[Record]:
    """Records of the collectives in a dump's ``entries`` (point-to-point ops are left out: a
    send is paired with a recv, so there is no same position to compare)."""
    if not isinstance(entries, list):
        raise ValueError(f"{source}: 'entries' is a {type(entries).__name__}, not a list")
    records = []
    for i, entry in enumerate(entries):
        try:
            if not entry.get("is_p2p", False):
                records.append(_record(entry))
        except (AttributeError, KeyError, TypeError, ValueError, IndexError) as exc:
            raise ValueError(
                f"{source}: entry {i} is not a Flight Recorder entry ({type(exc).__name__}: {exc})"
            ) from None
    return records


def _record(e: Mapping[str, Any]) -> Record:
    name, desc = e["process_group"][0], e["process_group"][1]
    group = f"torch pg {name}" + (f" ({desc})" if desc not in ("", "undefined") else "")
    op = str(e["profiling_name"]).split(":", 1)[-1]
    start = int(e["time_created_ns"]) / 1e9
    return Record(
        group,
        int(e["collective_seq_id"]),
        op,
        _shape(e, op),
        _site(e.get("frames")),
        start,
        _end(e, start),
    )


def _shape(e: Mapping[str, Any], op: str) -> str:
    """``[4, 2] float32``; only a scatter's outputs are the same on every rank, so for a
    scatter those are used, else the inputs (a gather's outputs exist only on the root)."""
    which = "output" if op == "scatter" else "input"
    sizes, dtypes = e[f"{which}_sizes"], e[f"{which}_dtypes"]
    if not sizes:
        return "-"
    parts = [f"{list(s)} {_DTYPES.get(d, str(d).lower())}" for s, d in zip(sizes, dtypes)]
    return ", ".join(parts)


def _site(frames: object) -> str:
    """``file:line in function`` of the first Python frame outside torch (and phalanx.comm);
    ``?`` if none (an op issued from C++, as DDP's reducer does, has no Python frames)."""
    for frame in frames if isinstance(frames, list) else []:
        file = str(frame.get("filename", ""))
        if file and not file.endswith(_C_SOURCES) and not _LIBRARY_FILE.search(file):
            return f"{file}:{frame.get('line', '?')} in {frame.get('name', '?')}"
    return "?"


def _end(e: Mapping[str, Any], start: float) -> float | None:
    """When it completed: NCCL's completion time; gloo records none and retires an entry when
    its work finishes, with or without an error, so there "completed" means finished."""
    done = e.get("time_discovered_completed_ns")
    if done:  # None in the pickle, 0 in the JSON when unknown
        return int(done) / 1e9
    if e.get("retired"):
        duration = e.get("duration_ms")
        return start + (float(duration) / 1e3 if duration else 0.0)
    return None


def merge_sites(dumps: Sequence[TorchDump]) -> None:
    """Blank every call site unless every dump has stacks (a JSON dump beside a pickle one):
    a site known on one rank and not on another is not a divergence."""
    if not all(d.has_frames for d in dumps):
        for d in dumps:
            for rec in d.records:
                rec.site = "?"
