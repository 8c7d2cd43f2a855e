"""Crafted DCP ``.metadata`` files: each refused quickly, naming the file, changing nothing.

One table, a row per crafted file (dcp_pickle.py, dcp_metadata.py): pickles that would run code
(``__reduce__`` to ``os.system`` in several protocols, ``eval``, ``INST``, ``OBJ``, persistent
ids, extension codes...), ``BUILD`` gadgets that name only allowed globals and would ``setattr``
on them (``PosixPath.__fspath__`` and a function's attribute, which made a later
``Path(...).write_text`` write another file; an enum's member tables), structures of 2**40
values in a few hundred bytes (a shared list or tuple as a ``size``, a shared tuple as a dict
key, which hung the reader in ``repr`` or ``hash``), a 200,000-deep ``size`` and bad data files.

The rows run in one child process, each timed on the process's CPU clock (a busy machine
stretches wall time, not CPU time) and the child under a wall-clock deadline, so a row that
hangs in C code (a hash) fails the test instead of hanging it. After every row the child
compares ``vars()`` of the classes, functions and modules a ``.metadata`` can name with a
snapshot taken before any row, checks that no marker file appeared, and that writing one file
through ``pathlib`` writes that file.
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as md

from tests.unit.pickle_bytes import child_reports, get, put, shared

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

CPU_LIMIT_S = 1.0
"""CPU seconds a row may take (the reader refuses each in milliseconds)."""
WALL_LIMIT_S = 120.0
"""Wall seconds for the whole child (a hung row never ends; torch's import takes a few)."""
_META = "torch.distributed.checkpoint.metadata"


# ---- a small pickle assembler (protocol 2 opcodes), for files pickle.dumps cannot write ----


def _s(text: str) -> bytes:
    raw = text.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw


def _g(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


_FAR = 90_000
"""Memo indices far above those pickle.dumps gives a small file."""


def _deep_list(depth: int) -> bytes:
    return b"]" * depth + b"a" * (depth - 1)


# ---- the real metadata, and crafted versions of it --------------------------------------------


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _real(directory: Path) -> md.Metadata:
    with open(directory / ".metadata", "rb") as f:  # torch's own file, in the test: trusted
        meta: md.Metadata = pickle.load(f)
    return meta


def _slot(meta: md.Metadata, where: str) -> bytes:
    """``meta`` pickled (protocol 2, explicit memo indices) with the slot ``where`` marked."""
    entry = meta.state_dict_metadata["model.weight"]
    assert isinstance(entry, md.TensorStorageMetadata)
    if where == "size":
        entry.size = "SLOT"  # type: ignore[assignment]
    else:
        meta.state_dict_metadata["SLOT"] = meta.state_dict_metadata.pop("model.weight")
    return pickle.dumps(meta, protocol=2)


def _in_slot(payload: bytes, where: str = "size") -> Callable[[Path, str], bytes]:
    def craft(directory: Path, marker: str) -> bytes:
        return _slot(_real(directory), where).replace(_s("SLOT"), payload, 1)

    return craft


def _whole(obj: Callable[[str], Any], protocol: int = 2) -> Callable[[Path, str], bytes]:
    return lambda directory, marker: pickle.dumps(obj(marker), protocol=protocol)


def _raw(payload: Callable[[str], bytes]) -> Callable[[Path, str], bytes]:
    return lambda directory, marker: payload(marker)


def _in_meta(change: Callable[[md.Metadata, str], None]) -> Callable[[Path, str], bytes]:
    def craft(directory: Path, marker: str) -> bytes:
        meta = _real(directory)
        change(meta, marker)
        return pickle.dumps(meta)

    return craft


def _planner_payload(meta: md.Metadata, marker: str) -> None:
    meta.planner_data["model.weight"] = _Payload(marker)


def _storage(**fields: Any) -> Callable[[md.Metadata, str], None]:
    def change(meta: md.Metadata, marker: str) -> None:
        storage = dict(meta.storage_data)
        key = next(k for k in storage if k.fqn == "model.weight")
        for name, value in fields.items():
            setattr(storage[key], name, value)
        meta.storage_data = storage

    return change


def _extra_field(meta: md.Metadata, marker: str) -> None:
    meta.state_dict_metadata["model.weight"].__dict__["extra"] = 1


def _fspath_gadget(marker: str) -> bytes:
    """``_get_layout.cache = {PosixPath(victim): decoy}``, then ``PosixPath.__fspath__ =
    _get_layout``: only allowed globals, and writing ``victim`` writes ``decoy``."""
    victim, decoy = marker + ".victim", marker + ".decoy"
    layout = _g("torch.serialization", "_get_layout") + put(1)
    path = _g("pathlib", "PosixPath") + b"(" + _s(victim) + b"tR"
    cache = b"}" + _s("cache") + b"}" + path + _s(decoy) + b"ss"
    fspath = _g("pathlib", "PosixPath") + b"(N}" + _s("__fspath__") + get(1) + b"stb0"
    return b"\x80\x02" + layout + cache + b"b0" + fspath + b"N."


_CACHE = b"}" + _s("cache") + b"}sb0N."
"""BUILD state ``{"cache": {}}``: a function's ``__dict__`` updated, its cache replaced."""


def _slot_gadget(module: str, name: str, attribute: str) -> bytes:
    """``setattr(module.name, attribute, torch.Size)`` by BUILD's slot state."""
    state = b"(N}" + _s(attribute) + _g("torch", "Size") + b"st"
    return _g(module, name) + state + b"b0N."


def _enum_gadget(marker: str) -> bytes:
    """Empties ``_MEM_FORMAT_ENCODING``'s member tables: every later DCP load fails."""
    tables = b"}" + _s("_value2member_map_") + b"}s" + _s("_member_map_") + b"}s"
    return b"\x80\x02" + _g(_META, "_MEM_FORMAT_ENCODING") + b"(N" + tables + b"tb0N."


def _code(module: str, name: str, arg: str) -> Callable[[str], bytes]:
    return lambda marker: b"\x80\x02" + _g(module, name) + b"(" + _s(arg) + b"tR."


ROWS: dict[str, tuple[Callable[[Path, str], bytes], str]] = {
    # code execution: the global is refused before anything is called
    "os.system via __reduce__, protocol 0": (_whole(_Payload, 0), "global posix.system"),
    "os.system via __reduce__, protocol 2": (_whole(_Payload, 2), "global posix.system"),
    "os.system via __reduce__, protocol 5": (_whole(_Payload, 5), "global posix.system"),
    "os.system inside a real Metadata": (
        _whole(lambda m: md.Metadata(state_dict_metadata={"x": _Payload(m)})),  # type: ignore[dict-item]
        "global posix.system",
    ),
    "os.system as a planner_data value": (_in_meta(_planner_payload), "global posix.system"),
    "builtins.eval": (_raw(_code("builtins", "eval", "1")), "global builtins.eval"),
    "builtins.exec": (_raw(_code("builtins", "exec", "1")), "global builtins.exec"),
    "builtins.getattr": (_raw(_code("builtins", "getattr", "x")), "global builtins.getattr"),
    "subprocess.Popen": (_raw(_code("subprocess", "Popen", "true")), "global subprocess.Popen"),
    "torch.load": (_raw(_code("torch", "load", "x")), "global torch.load"),
    "INST opcode": (_raw(lambda m: b"(S'true'\nios\nsystem\n."), "opcode INST"),
    "OBJ opcode": (_raw(lambda m: b"(cos\nsystem\nS'true'\no."), "global os.system"),
    "persistent id": (_raw(lambda m: b"\x80\x02" + _s("x") + b"Q."), "opcode BINPERSID"),
    "extension code": (_raw(lambda m: b"\x80\x02\x82\x01."), "opcode EXT1"),
    "REDUCE of a record class (its __init__)": (
        _raw(lambda m: b"\x80\x02" + _g(_META, "Metadata") + b"(}tR."),
        "REDUCE calls torch.distributed.checkpoint.metadata.Metadata",
    ),
    "NEWOBJ of an allowed non-record class": (
        _raw(lambda m: b"\x80\x02" + _g("pathlib", "PosixPath") + b")\x81."),
        "NEWOBJ of pathlib.PosixPath",
    ),
    # BUILD gadgets: only allowed globals, set on a class or function
    "BUILD: PosixPath.__fspath__ and _get_layout.cache": (
        _raw(_fspath_gadget),
        "a dict key that is a PurePosixPath",  # the first of its steps to be refused
    ),
    "BUILD: PosixPath.__fspath__": (
        _raw(lambda m: b"\x80\x02" + _slot_gadget("pathlib", "PosixPath", "__fspath__")),
        "BUILD on pathlib.PosixPath",
    ),
    "BUILD: a function's attribute": (
        _raw(lambda m: b"\x80\x02" + _g("torch.serialization", "_get_layout") + _CACHE),
        "BUILD on torch.serialization._get_layout",
    ),
    "BUILD: _MEM_FORMAT_ENCODING's member tables": (
        _raw(_enum_gadget),
        "BUILD on torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
    ),
    "BUILD: MetadataIndex.__hash__": (
        _raw(lambda m: b"\x80\x02" + _slot_gadget(_META, "MetadataIndex", "__hash__")),
        "BUILD on torch.distributed.checkpoint.metadata.MetadataIndex",
    ),
    "BUILD: an attribute that is not a field": (
        _in_meta(_extra_field),
        "'extra' is not a field of TensorStorageMetadata",
    ),
    # 2**40 values in a few hundred bytes, and depth
    "size: a 40-level shared list": (
        _in_slot(shared(40, "list", _FAR)),
        "a second reference to a list",
    ),
    "size: a 40-level shared tuple": (
        _in_slot(shared(40, "tuple", _FAR)),
        "counting shared references",
    ),
    "dict key: a 40-level shared tuple": (
        _in_slot(shared(40, "tuple", _FAR), "key"),
        "counting shared references",
    ),
    "size: 200,000 tuples deep": (_in_slot(b")" + b"\x85" * 200_000), "nested deeper than 100"),
    "size: 200,000 lists deep": (_in_slot(_deep_list(200_000)), "values on the pickle stack"),
    # data files
    "a data file name with a NUL byte": (
        _in_meta(_storage(relative_path="__0_0.distcp\0x")),
        "is not a plain file name",
    ),
    "a data file that is missing": (
        _in_meta(_storage(relative_path="__9_9.distcp")),
        "__9_9.distcp cannot be read (No such file or directory)",
    ),
}
"""Row -> (the crafting: (checkpoint dir, marker path) -> .metadata bytes, a piece of the
message that shows which check refused it)."""


# ---- the child: loads every row, one JSON line each -------------------------------------------


def _watched() -> list[Any]:
    """What a ``.metadata`` can name, and what those reach: classes, functions, modules."""
    import builtins
    import collections

    import torch.serialization
    from torch.distributed.checkpoint import filesystem

    records = [getattr(md, n) for n in md.__all__]
    paths = [pathlib.Path, pathlib.PosixPath, pathlib.PurePath, pathlib.PurePosixPath]
    paths += [pathlib.WindowsPath, pathlib.PureWindowsPath]
    return [
        *records,
        *paths,
        md._MEM_FORMAT_ENCODING,
        filesystem._StorageInfo,
        collections.OrderedDict,
        torch.Size,
        torch.serialization._get_layout,
        md,
        filesystem,
        torch.serialization,
        pathlib,
        builtins,
        os,
    ]


def _snapshot(watched: list[Any]) -> dict[str, Any]:
    """Every attribute of every watched object: its identity, and a dict's contents."""
    snap: dict[str, Any] = {}
    for obj in watched:
        owner = getattr(obj, "__qualname__", None) or obj.__name__
        for name, value in vars(obj).items():
            contents = tuple((k, id(v)) for k, v in value.items()) if type(value) is dict else None
            snap[f"{owner}.{name}"] = (id(value), contents)
    return snap


def _child(spec_file: str) -> None:
    from phalanx.checkpoint.dcp_interop import from_dcp

    spec = json.loads(Path(spec_file).read_text())
    from_dcp(spec["real"], spec["out"] + "/warm")  # fills torch's caches before the snapshot
    watched = _watched()
    before = _snapshot(watched)
    for row in spec["rows"]:
        marker = row["marker"]
        start = time.process_time()
        error, message, chained = "", "", False
        try:
            from_dcp(row["dir"], row["dir"] + ".out")
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            error, message = type(exc).__name__, str(exc)
            context = exc.__context__ is not None and not exc.__suppress_context__
            chained = exc.__cause__ is not None or context
        cpu = time.process_time() - start
        after = _snapshot(watched)
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        Path(marker + ".victim").write_text("x")  # through pathlib, as the gadget aimed at
        report = {
            "name": row["name"],
            "error": error,
            "message": message,
            "chained": chained,
            "cpu_s": cpu,
            "changed": changed,
            "marker": os.path.exists(marker),
            "decoy": os.path.exists(marker + ".decoy"),
        }
        print(json.dumps(report), flush=True)


# ---- the tests -------------------------------------------------------------------------------


def _save_real(directory: Path) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=directory)
    return directory


def _run_rows(root: Path) -> tuple[dict[str, dict[str, Any]], str]:
    real = _save_real(root / "real")
    rows = []
    for i, (name, (craft, _)) in enumerate(ROWS.items()):
        directory = root / f"row{i:02d}"
        shutil.copytree(real, directory)
        marker = str(root / f"marker{i:02d}")
        (directory / ".metadata").write_bytes(craft(directory, marker))
        rows.append({"name": name, "dir": str(directory), "marker": marker})
    spec = root / "rows.json"
    spec.write_text(json.dumps({"real": str(real), "out": str(root), "rows": rows}))
    return child_reports("tests.unit.test_checkpoint_crafted_dcp", str(spec), limit_s=WALL_LIMIT_S)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    return _run_rows(tmp_path_factory.mktemp("crafted_dcp"))


@pytest.mark.parametrize("row", list(ROWS))
def test_a_crafted_metadata_is_refused_quickly_naming_it_and_changes_nothing(
    results: tuple[dict[str, Any], str], row: str
) -> None:
    reports, stderr = results
    assert row in reports, f"{row}: no report: the reader hung or died on it\n{stderr}"
    report = reports[row]
    message = report["message"]
    assert report["error"] == "CheckpointError", report
    assert f"row{list(ROWS).index(row):02d}/.metadata" in message, message
    assert ROWS[row][1] in message, message
    # short, and its own: no chained traceback, no torch text
    assert len(message) < 500 and "Traceback" not in message and not report["chained"], message
    assert report["cpu_s"] < CPU_LIMIT_S, f"{row}: {report['cpu_s']:.2f} CPU seconds"
    assert report["changed"] == [], f"{row} changed {report['changed']}"
    assert not report["marker"] and not report["decoy"], report


def test_the_snapshot_sees_a_gadget(tmp_path: Path) -> None:
    # the comparison above can fail: applied with pickle itself, the gadget changes both
    watched = _watched()
    before = _snapshot(watched)
    saved = pathlib.PosixPath.__dict__.get("__fspath__")
    import torch.serialization

    cache = torch.serialization._get_layout.cache  # type: ignore[attr-defined]
    try:
        pickle.loads(_fspath_gadget(str(tmp_path / "m")))  # the test's own bytes
        changed = {k for k, v in _snapshot(watched).items() if before.get(k) != v}
        assert {"PosixPath.__fspath__", "_get_layout.cache"} <= changed, changed
        Path(str(tmp_path / "m") + ".victim").write_text("x")
        assert os.path.exists(f"{tmp_path}/m.decoy") and not os.path.exists(f"{tmp_path}/m.victim")
    finally:
        if saved is None:
            del pathlib.PosixPath.__fspath__
        torch.serialization._get_layout.cache = cache  # type: ignore[attr-defined]
    assert _snapshot(watched) == before


if __name__ == "__main__":
    _child(sys.argv[1])
