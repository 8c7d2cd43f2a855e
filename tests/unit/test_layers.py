"""The layers of phalanx: the wire (``phalanx.comm``) below the diagnostics, no upward import, no
circle.

Every import statement of every module under ``phalanx/comm`` and ``phalanx/diagnostics`` is read
with ``ast`` (those inside functions and ``if TYPE_CHECKING:`` too), so a lazy import cannot hide
a dependency:

- the wire imports nothing of the diagnostics, the data, the checkpoints, the training loop or
  the launcher: it offers a hook (``phalanx.comm.watch``) and the diagnostics install themselves;
- the diagnostics import neither the data nor the checkpoints, and the training loop only where
  it must (``ALLOWED_UPWARD``);
- no module of either package imports, at module level, one that imports it back, directly or
  through others (``if TYPE_CHECKING:`` counts: a circle hidden from the interpreter is still one).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGES = ("phalanx.comm", "phalanx.diagnostics")
WIRE_MUST_NOT_IMPORT = (
    "phalanx.diagnostics",
    "phalanx.data",
    "phalanx.checkpoint",
    "phalanx.train",
    "phalanx.launch",
)
DIAGNOSTICS_MUST_NOT_IMPORT = ("phalanx.data", "phalanx.checkpoint", "phalanx.train")
ALLOWED_UPWARD = {
    ("phalanx.diagnostics.job_timeline", "phalanx.train"): "it registers the timeline recorder "
    "with the job's observer registry (phalanx.train.observers), which imports it by name",
    ("phalanx.diagnostics.verify", "phalanx.train"): "phalanx verify observes a whole job: its "
    "probe registers with the job's observer registry and reads the model and optimizer",
    ("phalanx.diagnostics.verify", "phalanx.checkpoint"): "each step's snapshot is a checkpoint, "
    "which every strategy writes in its own form and which reads back whole at any world size",
}
"""(module or package, package it may import although the rules above forbid it) -> why."""


@dataclass(frozen=True)
class Import:
    """One imported module, as a statement of ``source`` names it."""

    source: str
    target: str
    line: int
    module_level: bool
    """Executed (or type-checked) when ``source`` is imported, not inside a function."""

    def __str__(self) -> str:
        return f"{self.source} imports {self.target} (line {self.line})"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str, root: Path) -> bool:
    base = root.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _resolve(node: ast.ImportFrom, source: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = source.split(".") if is_package else source.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join([*parts, *([node.module] if node.module else [])])


def _statements(body: list[ast.AST], module_level: bool = True) -> Iterator[tuple[ast.AST, bool]]:
    """Every statement under ``body``, with whether it runs (or is type-checked) at import."""
    for node in body:
        yield node, module_level
        inside = module_level and not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for field in ("body", "orelse", "finalbody", "handlers"):
            children = getattr(node, field, None)
            if isinstance(children, list):
                yield from _statements(children, inside)


def imports_of(path: Path, root: Path = SRC) -> list[Import]:
    """Every phalanx module ``path`` imports, wherever the statement is."""
    source = _module_name(path, root)
    tree = ast.parse(path.read_text(), str(path))
    out: list[Import] = []
    for node, module_level in _statements(list(tree.body)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, source, path.name == "__init__.py")
            for alias in node.names:  # a submodule, or a name of ``base``
                sub = f"{base}.{alias.name}"
                targets.append(sub if _is_module(sub, root) else base)
        out += [
            Import(source, t, node.lineno, module_level)
            for t in dict.fromkeys(targets)
            if t == "phalanx" or t.startswith("phalanx.")
        ]
    return out


def _modules(root: Path, package: str) -> list[Path]:
    return sorted(root.joinpath(*package.split(".")).rglob("*.py"))


def _all_imports(root: Path = SRC) -> list[Import]:
    return [
        imp for pkg in PACKAGES for path in _modules(root, pkg) for imp in imports_of(path, root)
    ]


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def upward_imports(root: Path = SRC) -> list[str]:
    """Rules 1 and 2: each import of a layer above, as ``module imports target (line n)``."""
    bad = []
    for imp in _all_imports(root):
        wire = _under(imp.source, "phalanx.comm")
        for package in WIRE_MUST_NOT_IMPORT if wire else DIAGNOSTICS_MUST_NOT_IMPORT:
            allowed = any(
                _under(imp.source, holder) and package == target
                for holder, target in ALLOWED_UPWARD
            )
            if _under(imp.target, package) and not allowed:
                layer = "phalanx.comm" if wire else "phalanx.diagnostics"
                bad.append(f"{imp}: {layer} must not import {package}")
    return bad


def import_cycles(root: Path = SRC) -> list[list[str]]:
    """Rule 3: the circles among module-level imports of the two packages (one path each)."""
    graph: dict[str, set[str]] = {}
    for imp in _all_imports(root):
        graph.setdefault(imp.source, set())
        inside = any(_under(imp.target, p) for p in PACKAGES)
        if imp.module_level and inside and imp.target != imp.source:
            graph[imp.source].add(imp.target)
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_the_reader_sees_every_kind_of_import(tmp_path: Path) -> None:
    pkg = tmp_path / "phalanx" / "comm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sibling.py").write_text("")
    (pkg / "probe.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import phalanx.data\n"
        "from . import sibling\n"
        "if TYPE_CHECKING:\n"
        "    from phalanx.train import Job\n"
        "def f():\n"
        "    from phalanx.checkpoint import save\n"
    )
    found = {(i.target, i.module_level) for i in imports_of(pkg / "probe.py", tmp_path)}
    assert found == {
        ("phalanx.data", True),
        ("phalanx.comm.sibling", True),
        ("phalanx.train", True),
        ("phalanx.checkpoint", False),
    }, found


def test_the_wire_and_the_diagnostics_import_no_layer_above() -> None:
    bad = upward_imports()
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_import_circle_in_the_wire_or_the_diagnostics() -> None:
    cycles = import_cycles()
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_any_phalanx_import_installs_the_diagnostics_on_the_wire() -> None:
    # A fresh interpreter whose first phalanx import is a module of the wire.
    code = (
        "import phalanx.comm.collectives\n"
        "from phalanx.comm import watch\n"
        "from phalanx.diagnostics import tracking\n"
        "assert watch.installed() is tracking, watch.installed()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
