"""No import cycles in ``src/phalanx``: every module's imports, read with ``ast``.

Imports inside functions count (they run too, later); imports under ``if TYPE_CHECKING:`` do
not (they never run). Relative imports are resolved against the importing module's package,
and ``from pkg import name`` counts as importing ``pkg.name`` when that is a module.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((SRC / "phalanx").rglob("*.py"))}


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of import nodes inside ``if TYPE_CHECKING:`` blocks."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skipped


def _imports(name: str, path: Path, known: set[str], types: bool = False) -> set[str]:
    """The modules ``name`` imports; with ``types``, those under ``if TYPE_CHECKING:`` too."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skipped, found = set() if types else _type_checking_only(tree), set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m in known and m != name}


def _ancestors(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _graph(types: bool = False) -> dict[str, set[str]]:
    """Module -> the modules importing it runs. Importing ``a.b.c`` runs ``a/__init__`` and
    ``a/b/__init__`` first, so those are edges too, except a module's own packages: they are
    being (or have been) initialised when it runs, and Python does not run them again. With
    ``types``, imports for annotations only count too."""
    modules = _modules()
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        deps = _imports(name, path, known, types)
        deps |= {a for d in deps for a in _ancestors(d) if a in known}
        graph[name] = deps - _ancestors(name) - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected component of more than one module (Tarjan), as a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walker_sees_a_cycle_when_there_is_one() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_function_level_imports_and_packages_are_edges() -> None:
    graph = _graph()
    # train/strategies/base.py imports strategies.role at the top; the mesh strategy imports
    # pipeline in a function body: both must be seen.
    assert "phalanx.train.strategies.role" in graph["phalanx.train.strategies.base"]
    assert "phalanx.pipeline" in graph["phalanx.train.strategies.mesh"]
    # importing a submodule runs its packages' __init__ first
    assert "phalanx.train.strategies" in graph["phalanx.train.job"]
    assert "phalanx.train" not in graph["phalanx.train.job"]  # its own package: already running


def test_relative_imports_resolve_against_the_package(tmp_path: Path) -> None:
    pkg = tmp_path / "phalanx" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from . import b\n    from .. import top\n")
    (pkg / "b.py").write_text("from .a import f\n")
    (tmp_path / "phalanx" / "top.py").write_text("")
    known = {"phalanx.pkg", "phalanx.pkg.a", "phalanx.pkg.b", "phalanx.top"}
    # "from . import b" imports the package (an ancestor: _graph drops it) and its module b
    wanted = {"phalanx.pkg", "phalanx.pkg.b", "phalanx.top"}
    assert _imports("phalanx.pkg.a", pkg / "a.py", known) == wanted
    assert _imports("phalanx.pkg.b", pkg / "b.py", known) == {"phalanx.pkg.a"}


def test_src_phalanx_has_no_import_cycle() -> None:
    graph = _graph()
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_train_modules_do_not_import_each_other_in_a_circle_even_for_types() -> None:
    # A helper that imports Job back "for types only" takes the whole job: the design this
    # rules out (DESIGN.md, one path through the training loop). Only train/'s own edges.
    graph = {
        name: {d for d in deps if d.startswith("phalanx.train.")}
        for name, deps in _graph(types=True).items()
        if name.startswith("phalanx.train.")
    }
    cycles = _cycles(graph)
    assert not cycles, "train/ import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_train_module_imports_the_job() -> None:
    # Job is the top: its parts take the training state, the runner and the resume point.
    importers = [n for n, deps in _graph(types=True).items() if "phalanx.train.job" in deps]
    assert sorted(importers) == ["phalanx.train"], importers
