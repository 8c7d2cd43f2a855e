"""The progress snapshot each rank publishes under ``progress/<rank>`` (:mod:`.tracking`).

Per group, ``[seq, last op]``: the number of this rank's last collective on that group and its
name; while the always-on check runs (:mod:`.mismatch_check`), ``[seq, last op, crc, window]``.
Tracking writes it; the check, validation and blame read other ranks' through
:func:`parse_progress`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["parse_progress"]


def parse_progress(value: Any) -> dict[str, list[Any]]:
    """A published snapshot: ``{group: [seq, last op]}`` or ``[seq, last op, crc, window]``."""
    if not isinstance(value, dict):
        raise TypeError("a progress snapshot is an object")
    for entry in value.values():
        if not (isinstance(entry, list) and len(entry) in (2, 4) and isinstance(entry[0], int)):
            raise TypeError(f"a progress entry is [seq, op] or [seq, op, crc, window]: {entry!r}")
    return value
