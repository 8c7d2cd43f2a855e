"""No import cycle through the sharded-state modules (sharding/, mesh/, checkpoint/).

Imports under ``if TYPE_CHECKING:`` count too: a cycle hidden from the interpreter is still one
for the reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import phalanx

PACKAGES = ("phalanx.sharding", "phalanx.mesh", "phalanx.checkpoint")


def _modules() -> dict[str, Path]:
    src = Path(phalanx.__file__).parent
    out = {}
    for path in src.rglob("*.py"):
        parts = list(path.relative_to(src.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            for a in node.names:  # `from pkg import module` names the module, not the package
                target = f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                if target in known:
                    out.add(target)
    return out


def _cycle_from(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    """A path start -> ... -> start, if there is one (depth-first)."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in graph[node]:
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


def test_no_import_cycle_through_the_sharded_state_modules() -> None:
    known = _modules()
    graph = {name: _imports(name, path, known) for name, path in known.items()}
    ours = [m for m in known if m.startswith(PACKAGES) and m not in PACKAGES]
    assert len(ours) > 20  # the walk found the modules
    assert "phalanx.sharding.zero_state" in graph["phalanx.sharding.zero_pieces"]  # edges seen
    cycles = [c for m in sorted(ours) if (c := _cycle_from(m, graph))]
    assert cycles == []
