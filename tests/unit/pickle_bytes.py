"""Hand-written pickle opcodes for the crafted-pickle tables (plain data and DCP metadata), and
the child process that reads them under a deadline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["ROOT", "child_reports", "get", "put", "shared"]

ROOT = Path(__file__).resolve().parents[2]
"""The repository: crafted-pickle children run their test module from there (``python -m``)."""


def put(i: int) -> bytes:
    """``LONG_BINPUT i``: memoize the top of the stack at index ``i``."""
    return b"r" + i.to_bytes(4, "little")


def get(i: int) -> bytes:
    """``LONG_BINGET i``: push memo entry ``i`` again (a second reference to it)."""
    return b"j" + i.to_bytes(4, "little")


def shared(levels: int, kind: str, base: int = 0) -> bytes:
    """A tuple or list whose every level holds the previous level twice: 2**levels values in
    about 12 bytes a level (memo indices from ``base``)."""
    first, step = (b")", b"%s%s\x86") if kind == "tuple" else (b"]", b"](%s%se")
    out = first + put(base) + b"0"
    for i in range(levels):
        out += step % (get(base + i), get(base + i)) + put(base + i + 1) + b"0"
    return out + get(base + levels)


def child_reports(module: str, *args: str, limit_s: float) -> tuple[dict[str, dict[str, Any]], str]:
    """Run ``python -m module *args`` from the repository root, under a wall-clock limit (a hung
    row never ends), and return its JSON report lines by ``name`` and the tail of its stderr."""
    command = [sys.executable, "-m", module, *args]
    try:
        done = subprocess.run(command, capture_output=True, timeout=limit_s, cwd=ROOT)
        out, err = done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        out, err = exc.stdout or b"", exc.stderr or b""
    reports = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    return {r["name"]: r for r in reports}, err.decode()[-2000:]
