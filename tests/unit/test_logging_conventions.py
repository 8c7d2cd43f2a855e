"""phalanx's modules only log: no handlers, no basicConfig, no propagate switches, named loggers.

The programs (the ``phalanx`` command, the launcher, the benchmarks) may configure their own
output; in the library the one exception is :func:`phalanx.train.loop_helpers.configure_logging`
(a Job's default output, added only where the program configured nothing; see
tests/e2e/test_logging.py).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "phalanx"
ALLOWED = {SRC / "train" / "loop_helpers.py", SRC / "cli.py", SRC / "__main__.py"}
PROGRAMS = (SRC / "launch", SRC / "bench")
CONFIGURES = {"addHandler", "basicConfig", "dictConfig", "fileConfig", "setLoggerClass"}


def _violations(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        where = f"{path.relative_to(SRC)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = node.func.attr
            if name in CONFIGURES:
                found.append(f"{where}: {name}()")
            by_name = [a for a in node.args if not (isinstance(a, ast.Name) and a.id == "__name__")]
            if name == "getLogger" and by_name:
                found.append(f"{where}: getLogger(...) not of __name__")
        if isinstance(node, ast.Attribute) and node.attr == "propagate":
            found.append(f"{where}: .propagate")
    return found


def test_library_modules_add_no_handlers_and_log_under_their_module_name() -> None:
    library = [
        p
        for p in sorted(SRC.rglob("*.py"))
        if p not in ALLOWED and not any(d in p.parents for d in PROGRAMS)
    ]
    found = [v for p in library for v in _violations(p)]
    assert found == []


def test_unconfigured_warnings_still_reach_stderr() -> None:
    # No NullHandler on "phalanx": a program that configures nothing sees phalanx's warnings
    # (Python's last-resort handler), as it would any library's.
    code = "import phalanx, logging; logging.getLogger('phalanx.checkpoint.catalog').warning('W!')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stderr.strip() == "W!", proc.stderr
