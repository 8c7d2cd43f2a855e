"""No module of phalanx deserialises bytes with pickle (or anything that runs code on load).

A pickle runs code chosen by whoever wrote the bytes. phalanx's wire formats (the parameter
server header, the object collectives' codec, checkpoints) are numbers, JSON and safetensors, so a
peer or a file can send data but never code. This test walks ``src/phalanx`` with ``ast``, resolves
import aliases (``import pickle as p``, ``from torch import load``, ``import torch.distributed as
dist``) and fails on every reference to a deserialiser, naming file and line, unless the site is
in ``ALLOWED`` with the reason it is safe.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

UNPICKLERS = frozenset(
    {
        "pickle.load",
        "pickle.loads",
        "pickle.Unpickler",
        "_pickle.load",
        "_pickle.loads",
        "_pickle.Unpickler",
        "marshal.load",
        "marshal.loads",
        "torch.load",
        "torch.serialization.load",
        "shelve.open",
    }
)
"""Callables that turn bytes into objects by running what the bytes say."""
UNPICKLING_MODULES = ("dill", "cloudpickle", "jsonpickle")
"""Modules whose whole purpose is (un)pickling more than pickle does: any use is flagged."""
OBJECT_COLLECTIVES = frozenset(
    f"torch.distributed.{name}"
    for name in (
        "all_gather_object",
        "broadcast_object_list",
        "gather_object",
        "scatter_object_list",
        "recv_object_list",
        "send_object_list",
    )
)
"""torch's object collectives pickle on one rank and unpickle on the others: network bytes.
phalanx.comm.objects has the same signatures over a pickle-free codec."""

ALLOWED: dict[tuple[str, str, str], str] = {
    ("phalanx/testing.py", "_collect", "pickle.loads"): (
        "run_distributed's result pipe: bytes come from the test harness's own child processes "
        "over a multiprocessing Pipe created by the parent (never a socket a peer can reach); "
        "the children are started by the same test and run the same code"
    ),
    ("phalanx/checkpoint/torch_import.py", "import_torch_state_dict", "torch.load"): (
        "reads a local file the user names, with weights_only=True passed explicitly (torch's "
        "restricted unpickler: tensors and plain containers only; checked below), never bytes "
        "from the network"
    ),
    ("phalanx/checkpoint/dcp_interop.py", "load_bytes", "torch.load"): (
        "a non-tensor value of a torch DCP checkpoint the user converts, a local file, read with "
        "weights_only=True passed explicitly (torch's restricted unpickler), never network bytes"
    ),
}
"""(file under src/, enclosing function, qualified name) -> why that call site is safe."""


@dataclass(frozen=True)
class Hit:
    """One reference to a deserialiser."""

    file: str
    line: int
    function: str
    name: str

    def __str__(self) -> str:
        return f"src/{self.file}:{self.line} in {self.function}(): {self.name}"


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> qualified name, for every import anywhere in the module."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                # `import torch.distributed` binds `torch`; `import x.y as z` binds z -> x.y
                names[a.asname or a.name.split(".")[0]] = (
                    a.name if a.asname else a.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _qualname(node: ast.AST, aliases: dict[str, str]) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id], *reversed(parts)])


def _flagged(name: str, forbidden: frozenset[str]) -> bool:
    return name in forbidden or any(
        name == m or name.startswith(m + ".") for m in UNPICKLING_MODULES
    )


def _functions(tree: ast.AST) -> dict[int, str]:
    """id(node) -> name of the innermost enclosing function, for every node."""
    owner: dict[int, str] = {}

    def visit(node: ast.AST, current: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            current = node.name
        owner[id(node)] = current
        for child in ast.iter_child_nodes(node):
            visit(child, current)

    visit(tree, "<module>")
    return owner


def _may_refer(source: str, forbidden: frozenset[str]) -> bool:
    """Cheap filter: any reference, however aliased, spells the last part of the name."""
    words = {name.rsplit(".", 1)[-1] for name in forbidden} | set(UNPICKLING_MODULES)
    return any(re.search(rf"\b{word}\b", source) for word in words)


def scan(source: str, file: str, forbidden: frozenset[str]) -> Iterator[Hit]:
    """Every reference in ``source`` to a name in ``forbidden`` or an unpickling module."""
    if not _may_refer(source, forbidden):
        return
    tree = ast.parse(source, filename=file)
    aliases, owner = _aliases(tree), _functions(tree)
    # only the outermost attribute chain is reported: `a.b.c`, not also its `a.b`
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            for mod in mods:
                if mod and _flagged(mod, frozenset()):
                    yield Hit(file, node.lineno, owner[id(node)], f"import {mod}")
        elif isinstance(node, ast.Attribute | ast.Name) and id(node) not in inner:
            name = _qualname(node, aliases)
            if name and _flagged(name, forbidden):
                yield Hit(file, node.lineno, owner[id(node)], name)


@functools.cache
def _modules() -> tuple[tuple[str, str], ...]:
    """(path under src/, source) of every module of phalanx, read once per session."""
    paths = sorted((SRC / "phalanx").rglob("*.py"))
    return tuple((p.relative_to(SRC).as_posix(), p.read_text(encoding="utf-8")) for p in paths)


@functools.cache
def _all_hits() -> tuple[Hit, ...]:
    """Every flagged reference in src/phalanx, scanned once for all the tests below."""
    names = UNPICKLERS | OBJECT_COLLECTIVES
    return tuple(h for rel, source in _modules() for h in scan(source, rel, names))


def _call_of(hit: Hit, tree_source: str) -> ast.Call | None:
    for node in ast.walk(ast.parse(tree_source)):
        if (
            isinstance(node, ast.Call)
            and node.func.lineno == hit.line
            and ast.unparse(node.func).endswith(hit.name.split(".")[-1])
        ):
            return node
    return None


def test_no_unpickling_in_src_phalanx() -> None:
    hits = [h for h in _all_hits() if h.name not in OBJECT_COLLECTIVES]
    bad = [h for h in hits if (h.file, h.function, h.name) not in ALLOWED]
    listing = "\n".join(map(str, bad))
    assert not bad, (
        "deserialisers that run code from the bytes (use safetensors / JSON / phalanx.comm.codec, "
        f"or add the site to ALLOWED with a reason):\n{listing}"
    )
    # every allowed site must still exist: a stale entry would silently allow a new call there
    found = {(h.file, h.function, h.name) for h in hits}
    stale = sorted(set(ALLOWED) - found)
    assert not stale, f"ALLOWED entries with no matching call site (remove them): {stale}"


def _restricted_problems(source: str, hits: list[Hit]) -> list[str]:
    """The torch.load ``hits`` in ``source`` lacking the literal ``weights_only=True``."""
    problems = []
    for hit in (h for h in hits if h.name == "torch.load"):
        call = _call_of(hit, source)
        if call is None:
            problems.append(f"{hit}: referenced but not called directly")
            continue
        flag = [k.value for k in call.keywords if k.arg == "weights_only"]
        if not (len(flag) == 1 and isinstance(flag[0], ast.Constant) and flag[0].value is True):
            # an environment variable can flip torch's default to the unrestricted unpickler
            problems.append(f"{hit}: must pass the literal weights_only=True")
    return problems


def test_allowed_torch_load_is_restricted() -> None:
    sources = dict(_modules())
    problems = [p for h in _all_hits() for p in _restricted_problems(sources[h.file], [h])]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("call", "ok"),
    [
        ("torch.load(f, weights_only=True)", True),
        ("torch.load(f)", False),
        ("torch.load(f, weights_only=False)", False),
        ("torch.load(f, weights_only=flag)", False),
        ("g = torch.load", False),
    ],
)
def test_weights_only_check(call: str, ok: bool) -> None:
    source = f"import torch\n{call}\n"
    hits = list(scan(source, "x.py", UNPICKLERS))
    assert len(hits) == 1 and (_restricted_problems(source, hits) == []) == ok


def test_no_torch_object_collectives() -> None:
    hits = [h for h in _all_hits() if h.name in OBJECT_COLLECTIVES]
    assert not hits, (
        "torch's object collectives unpickle what peers send; use phalanx.comm.objects' "
        "pickle-free functions of the same name:\n" + "\n".join(map(str, hits))
    )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import pickle\ndef f(b):\n    return pickle.loads(b)\n", ["f:3:pickle.loads"]),
        ("import pickle as p\nx = p.load(open('f', 'rb'))\n", ["<module>:2:pickle.load"]),
        ("from pickle import loads as L\ndef g(b):\n    return L(b)\n", ["g:3:pickle.loads"]),
        ("import pickle\nclass U(pickle.Unpickler):\n    pass\n", ["<module>:2:pickle.Unpickler"]),
        ("import torch\ndef h(f):\n    return torch.load(f)\n", ["h:3:torch.load"]),
        ("from torch import load\nload('x')\n", ["<module>:2:torch.load"]),
        ("import marshal\nmarshal.loads(b'')\n", ["<module>:2:marshal.loads"]),
        ("import dill\n", ["<module>:1:import dill"]),
        ("def f():\n    import cloudpickle\n", ["f:2:import cloudpickle"]),
        ("import pickle\npickle.dumps(1)\nimport torch\ntorch.save({}, 'f')\n", []),
        ("import json\njson.loads('1')\nloads = 3\n", []),
    ],
)
def test_scanner_finds_every_spelling(source: str, expected: list[str]) -> None:
    hits = list(scan(source, "x.py", UNPICKLERS))
    assert [f"{h.function}:{h.line}:{h.name}" for h in hits] == expected


def test_scanner_finds_torch_object_collectives() -> None:
    source = (
        "import torch.distributed as dist\n"
        "import torch\n"
        "from torch.distributed import broadcast_object_list as b\n"
        "dist.all_gather_object([], 1)\n"
        "torch.distributed.recv_object_list([])\n"
        "b([])\n"
    )
    hits = [(h.line, h.name) for h in scan(source, "x.py", OBJECT_COLLECTIVES)]
    assert hits == [
        (4, "torch.distributed.all_gather_object"),
        (5, "torch.distributed.recv_object_list"),
        (6, "torch.distributed.broadcast_object_list"),
    ]
