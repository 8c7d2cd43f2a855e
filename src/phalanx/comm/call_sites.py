"""Where a collective was called from: the first frame outside the transports.

:func:`call_site` gives it as text (``file:line in function``, for records and reports);
:func:`site_of_caller` as a number every rank computes alike (the CRC-32 of that text), which the
shm backend's call descriptors carry so that the ranks can tell a skipped or extra collective
whose neighbours share a signature (``shm/descriptor.find_shift``). One frame walk serves both,
and it costs well under a microsecond: whether a code object is a transport, and each line's
number and text, are computed once and kept.
"""

from __future__ import annotations

import sys
import zlib
from types import CodeType, FrameType

__all__ = ["TRANSPORTS", "UNKNOWN", "call_site", "describe", "site_of_caller"]

TRANSPORTS = (
    "phalanx/comm/",
    "torch/",
    "phalanx/pipeline/p2p.py",
    "phalanx/parameter_server/wire",
    "phalanx/diagnostics/tracking.py",
)
"""Frames a call site skips: the code that only moves tensors for its caller, and the wire's
watcher that asks (``phalanx.diagnostics.tracking``, called from inside the wire)."""

UNKNOWN = 0
"""No Python caller outside the transports (torch's DDP reducer calls from C++)."""
_MAX = 4096
_transport: dict[CodeType, bool] = {}
_numbers: dict[tuple[CodeType, int], int] = {}
_names: dict[int, str] = {}


def _learn(code: CodeType) -> bool:
    if len(_transport) >= _MAX:
        _transport.clear()
    path = code.co_filename.replace("\\", "/")
    known = _transport[code] = any(part in path for part in TRANSPORTS)
    return known


def _number(code: CodeType, line: int) -> int:
    if len(_numbers) >= _MAX:
        _numbers.clear()
        _names.clear()
    path = code.co_filename.replace("\\", "/")
    where = f"{path}:{line} in {code.co_name}"
    number = _numbers[(code, line)] = zlib.crc32(where.encode()) or 1
    _names[number] = where
    return number


def site_of_caller() -> int:
    """The number of the line that issued the collective being made (:data:`UNKNOWN`: none)."""
    frame: FrameType | None = sys._getframe(1)
    transport = _transport.get  # this runs for every call: a loop of dict look-ups
    while frame is not None:
        code = frame.f_code
        skip = transport(code)
        if skip is None:
            skip = _learn(code)
        if not skip:
            line = frame.f_lineno
            return _numbers.get((code, line)) or _number(code, line)
        frame = frame.f_back
    return UNKNOWN


def call_site() -> str:
    """``file:line in function`` of the first caller outside the transports (``?``: none)."""
    number = site_of_caller()
    return _names.get(number, "?")  # UNKNOWN has no name


def describe(number: int) -> str:
    """``file:line in function`` of a site number this process has seen, else a placeholder."""
    if number == UNKNOWN:
        return "no Python caller"
    return _names.get(number, "a line this rank never called from")
