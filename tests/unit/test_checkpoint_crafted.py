"""Crafted checkpoint files: each is a CheckpointError naming the file, within a second.

One table, a row per crafted file: what it claims (a huge world size, a FIFO, deep nesting, a
2**63 dimension, an oversized JSON file, a list where an object belongs, a truncated
``torch.save`` file, ...). Every row runs under a one-second alarm, so a reader that hangs or
spins fails the row instead of the suite; nothing large is written or allocated (the JSON size
cap is shown by lowering it, not with a 1 GiB file).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from phalanx import checkpoint
from phalanx.checkpoint.limits import MAX_JSON_ENV

DEADLINE_S = 1.0
DEEP = 20_000  # beyond the JSON parser's recursion limit, 40 KB: under the lowered cap
SHALLOWER = 500  # within it: the decoder (structure.unflatten) would recurse instead
CAP_MB = "0.0625"  # 64 KiB: the JSON cap lowered for the test (the default is 64 MiB)


class _Hung(BaseException):
    """Raised by the alarm; a BaseException so that no ``except Exception`` swallows it."""


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    def ring(signum: int, frame: object) -> None:
        raise _Hung(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class _Saved:
    root: Path
    step: Path
    model: nn.Module
    optimizer: torch.optim.Optimizer

    def load(self) -> Any:
        return checkpoint.load(self.root, model=self.model, optimizer=self.optimizer)

    def manifest(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads((self.step / "manifest.json").read_text())
        return doc

    def write_manifest(self, doc: dict[str, Any]) -> None:
        (self.step / "manifest.json").write_text(json.dumps(doc))

    def plant(self, name: str, raw: bytes) -> None:
        """Write ``name`` and record its true size and sha256, so only its content is wrong."""
        (self.step / name).write_bytes(raw)
        doc = self.manifest()
        doc["files"][name] = {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}
        self.write_manifest(doc)


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _safetensors(header: bytes) -> bytes:
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header


def _section(state: bytes) -> bytes:
    return b'{"tensor_files":[],"state":' + state + b"}"


def _shard_index(meta: dict[str, Any], index: list[Any]) -> bytes:
    return _section(json.dumps({"meta": meta, "index": index, "tensors": {}}).encode())


# ---- the crafted files: each returns the call that must fail and the file it must name ----


def _world_size(s: _Saved) -> tuple[Callable[[], Any], Path]:
    doc = s.manifest()
    doc["world_size"] = 10**9
    s.write_manifest(doc)
    return s.load, s.step / "manifest.json"


def _fifo(name: str) -> Callable[[_Saved], tuple[Callable[[], Any], Path]]:
    def craft(s: _Saved) -> tuple[Callable[[], Any], Path]:
        path = (s.root if name == "latest" else s.step) / name
        path.unlink()
        os.mkfifo(path)
        return s.load, path

    return craft


def _deep_manifest(s: _Saved) -> tuple[Callable[[], Any], Path]:
    raw = (s.step / "manifest.json").read_bytes().replace(b'"extra": {}', b'"extra": {"x": %s}')
    (s.step / "manifest.json").write_bytes(raw % _nested(DEEP))
    return s.load, s.step / "manifest.json"


def _deep_extra(s: _Saved) -> tuple[Callable[[], Any], Path]:
    doc = s.manifest()
    doc["extra"] = {"x": json.loads(_nested(SHALLOWER))}
    s.write_manifest(doc)
    return s.load, s.step / "manifest.json"


def _deep_section(depth: int) -> Callable[[_Saved], tuple[Callable[[], Any], Path]]:
    def craft(s: _Saved) -> tuple[Callable[[], Any], Path]:
        s.plant("model.json", _section(_nested(depth)))
        return s.load, s.step / "model.json"

    return craft


def _deep_header(s: _Saved) -> tuple[Callable[[], Any], Path]:
    s.plant("model.safetensors", _safetensors(b'{"__metadata__":' + _nested(DEEP) + b"}"))
    return s.load, s.step / "model.safetensors"


def _huge_dimension(s: _Saved) -> tuple[Callable[[], Any], Path]:
    entry = {"dtype": "F32", "shape": [2**63, 0], "data_offsets": [0, 0]}
    s.plant("model.safetensors", _safetensors(json.dumps({"w": entry}).encode()))
    return s.load, s.step / "model.safetensors"


def _oversized(name: str) -> Callable[[_Saved], tuple[Callable[[], Any], Path]]:
    def craft(s: _Saved) -> tuple[Callable[[], Any], Path]:
        big = b'"' + b"x" * (128 * 1024) + b'"'  # twice the lowered cap
        if name == "manifest.json":
            raw = (s.step / name).read_bytes().replace(b'"extra": {}', b'"extra": {"x": %s}')
            (s.step / name).write_bytes(raw % big)
        else:
            s.plant(name, _section(big))
        return s.load, s.step / name

    return craft


def _list_rank_file(s: _Saved) -> tuple[Callable[[], Any], Path]:
    s.plant("rank-00000.json", _section(b"[1, 2, 3]"))
    return s.load, s.step / "rank-00000.json"


def _shard(meta: dict[str, Any], index: list[Any]) -> Callable[[_Saved], Any]:
    def craft(s: _Saved) -> tuple[Callable[[], Any], Path]:
        s.plant("optimizer-shard-00000.json", _shard_index(meta, index))
        return s.load, s.step / "optimizer-shard-00000.json"

    return craft


def _truncated_torch_save(s: _Saved) -> tuple[Callable[[], Any], Path]:
    path = s.root / "weights.pt"
    torch.save(s.model.state_dict(), path)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    return lambda: checkpoint.import_torch_state_dict(path), path


def _fifo_torch_save(s: _Saved) -> tuple[Callable[[], Any], Path]:
    path = s.root / "weights.pt"
    os.mkfifo(path)
    return lambda: checkpoint.import_torch_state_dict(path), path


_GROUPS = [{"lr": 0.1, "params": [0, 1]}]
NESTED = "JSON nested deeper than 100 levels"
OVER_CAP = "over the 65536-byte limit of a checkpoint JSON file"
ROWS: dict[str, tuple[Callable[[_Saved], tuple[Callable[[], Any], Path]], str]] = {
    "manifest world_size 10**9": (_world_size, "world_size 1000000000 does not match"),
    "FIFO named latest": (_fifo("latest"), "is a FIFO, not a regular file"),
    "FIFO named model.safetensors": (_fifo("model.safetensors"), "is a FIFO"),
    "deep nesting: manifest.json (parser)": (_deep_manifest, NESTED),
    "deep nesting: manifest extra (decoder)": (_deep_extra, NESTED),
    "deep nesting: section JSON (parser)": (_deep_section(DEEP), NESTED),
    "deep nesting: section JSON (decoder)": (_deep_section(SHALLOWER), NESTED),
    "deep nesting: safetensors header (parser)": (_deep_header, NESTED),
    "2**63 dimension in a safetensors header": (_huge_dimension, "invalid shape"),
    "2**63 dimension in a sharded index": (
        _shard({}, [[["w", [2**63], 0, 0, "float32"], "t0"]]),
        "malformed piece index entry",
    ),
    "sharded index claiming 4 TB": (
        _shard({}, [[["w", [10**12], 0, 10**12, "float32"], "t0"]]),
        "its pieces claim 4000000000000 bytes, its tensor files hold 0",
    ),
    "sharded index with a non-dtype": (
        _shard({}, [[["w", [2], 0, 0, "nn"], "t0"]]),
        "malformed piece index entry",
    ),
    "optimizer meta num_params 10**9": (
        _shard({"num_params": 10**9, "param_groups": _GROUPS}, []),
        "num_params 1000000000 is not the number of parameters",
    ),
    "sharded optimizer meta of no optimizer": (_shard({}, []), "pieces do not fit"),
    "manifest.json over the JSON cap": (_oversized("manifest.json"), OVER_CAP),
    "section JSON over the JSON cap": (_oversized("model.json"), OVER_CAP),
    "list-shaped rank file": (_list_rank_file, "a rank's state is an object"),
    "truncated torch.save file": (_truncated_torch_save, "not a readable torch.save file"),
    "FIFO given to import_torch_state_dict": (_fifo_torch_save, "is a FIFO"),
}
"""Row -> (the crafting, a piece of the message that shows which check refused it)."""


@pytest.fixture
def saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> _Saved:
    monkeypatch.setenv(MAX_JSON_ENV, CAP_MB)
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    step = checkpoint.save(tmp_path, 3, model=model, optimizer=opt, keep_last=None)
    assert (step / "manifest.json").stat().st_size < 16 * 1024  # well under the lowered cap
    return _Saved(tmp_path, step, model, opt)


@pytest.mark.parametrize("row", list(ROWS))
def test_a_crafted_file_is_a_checkpoint_error_naming_it_within_a_second(
    saved: _Saved, row: str
) -> None:
    craft, message = ROWS[row]
    call, named = craft(saved)
    start = time.monotonic()
    with _deadline(DEADLINE_S), pytest.raises(checkpoint.CheckpointError) as err:
        call()
    elapsed = time.monotonic() - start
    assert str(named) in str(err.value) and message in str(err.value), err.value
    assert "Exception raised from" not in str(err.value)  # no C++ frame dump
    assert elapsed < DEADLINE_S, f"{row}: {elapsed:.2f} s"


def test_the_untouched_checkpoint_loads(saved: _Saved) -> None:
    # the rows fail because of what was crafted, not because the fixture is unloadable
    info = saved.load()
    assert info is not None and info.step == 3


def test_save_refuses_what_load_would_refuse(saved: _Saved) -> None:
    deep: Any = []
    for _ in range(120):
        deep = [deep]
    with pytest.raises(ValueError, match="nests deeper than a checkpoint stores"):
        checkpoint.save(saved.root, 4, model=saved.model, objects={"o": _State(deep)})
    big = {"x": "y" * (128 * 1024)}
    with pytest.raises(ValueError, match=f"objects.json would be .* {MAX_JSON_ENV}"):
        checkpoint.save(saved.root, 4, model=saved.model, objects={"o": _State(big)})
    with pytest.raises(ValueError, match=r"save\(extra=\.\.\.\) nests deeper than 99 levels"):
        checkpoint.save(saved.root, 4, model=saved.model, extra={"x": deep})
    with pytest.raises(ValueError, match=f"manifest.json would be .* {MAX_JSON_ENV}"):
        checkpoint.save(saved.root, 4, model=saved.model, extra=big)
    assert checkpoint.latest(saved.root) == saved.step
    assert sorted(os.listdir(saved.root)) == ["latest", "step-000003"]  # nothing left behind


class _State:
    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state
