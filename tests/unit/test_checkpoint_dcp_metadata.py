"""DCP's pickled ``.metadata`` is read without running code and within bounds (dcp_metadata.py)."""

from __future__ import annotations

import dataclasses
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as md

from phalanx.checkpoint import CheckpointError
from phalanx.checkpoint.dcp_interop import from_dcp, read_dcp, to_dcp
from phalanx.checkpoint.dcp_metadata import read_metadata

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    dcp.save(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
    return tmp_path / "dcp"


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _metadata(directory: Path) -> md.Metadata:
    with open(directory / ".metadata", "rb") as f:  # our own file, in the test: trusted
        return pickle.load(f)


def _write(directory: Path, obj: Any) -> None:
    (directory / ".metadata").write_bytes(pickle.dumps(obj))


def test_a_pickle_payload_is_refused_without_running(saved: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    _write(saved, _Payload(marker))
    with pytest.raises(CheckpointError, match=r"\.metadata: .*global posix\.system"):
        read_dcp(saved)
    assert not marker.exists()
    inside = {"x": _Payload(marker)}
    _write(saved, md.Metadata(state_dict_metadata=inside))  # nested in a real Metadata
    with pytest.raises(CheckpointError, match=r"\.metadata: .*refusing"):
        from_dcp(saved, tmp_path / "ph")
    assert not marker.exists() and not (tmp_path / "ph").exists()


def test_other_globals_are_refused(saved: Path) -> None:
    _write(saved, {"f": eval})
    with pytest.raises(CheckpointError, match=r"global builtins\.eval"):
        read_dcp(saved)


def _crafted(saved: Path, change: str) -> None:
    meta = _metadata(saved)
    fqn = "model.weight"
    entry = meta.state_dict_metadata[fqn]
    assert isinstance(entry, md.TensorStorageMetadata)
    if change == "huge":
        meta.state_dict_metadata[fqn] = dataclasses.replace(entry, size=torch.Size([2**40, 2]))
    elif change == "outside":
        storage = dict(meta.storage_data)
        key = next(k for k in storage if k.fqn == fqn)
        storage[key] = dataclasses.replace(storage[key], relative_path="../../etc/passwd")
        meta.storage_data = storage
    elif change == "past-end":
        storage = dict(meta.storage_data)
        key = next(k for k in storage if k.fqn == fqn)
        storage[key] = dataclasses.replace(storage[key], length=10**9)
        meta.storage_data = storage
    elif change == "long-list":
        meta.planner_data["model.weight"] = ("model", 10**12)
    _write(saved, meta)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("huge", r"tensors claim \d+ bytes, its data files hold \d+"),
        ("outside", r"'\.\./\.\./etc/passwd' is not a plain file name"),
        ("past-end", r"bytes \d+\+1000000000 of __0_0\.distcp"),
        ("long-list", r"path of 'model\.weight' is not a tuple .* indices below \d+"),
    ],
)
def test_crafted_entries_are_refused_before_allocating(
    saved: Path, change: str, message: str
) -> None:
    _crafted(saved, change)
    with pytest.raises(CheckpointError, match=rf"dcp/\.metadata: .*{message}"):
        read_dcp(saved)


def test_a_fifo_or_oversized_metadata_is_refused(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PHALANX_CHECKPOINT_MAX_JSON_MB", "0.001")
    with pytest.raises(CheckpointError, match=r"\.metadata: \d+ bytes, over the 1048-byte limit"):
        read_dcp(saved)
    monkeypatch.delenv("PHALANX_CHECKPOINT_MAX_JSON_MB")
    (saved / ".metadata").unlink()
    os.mkfifo(saved / ".metadata")
    with pytest.raises(CheckpointError, match=r"\.metadata: is a FIFO, not a regular file"):
        read_dcp(saved)


def test_the_untouched_checkpoint_reads_back_exactly(saved: Path) -> None:
    state = read_dcp(saved)
    assert state["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert set(state["optimizer"]["state"]) == {"0", "1"}  # DCP keeps index keys as strings
    assert state["optimizer"]["state"]["0"]["step"].dtype == torch.float32


def test_bad_arguments_are_named(saved: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"from_dcp\(src='/nonexistent'\): src must be an exist"):
        from_dcp("/nonexistent", tmp_path / "ph")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty/\.metadata: no such file"):
        from_dcp(tmp_path / "empty", tmp_path / "x")
    from_dcp(saved, tmp_path / "ok")
    with pytest.raises(ValueError, match=r"param_names=...\): 1 names \(1 distinct\) for an "):
        to_dcp(tmp_path / "ok", tmp_path / "dcp2", param_names=["weight"])
    with pytest.raises(CheckpointError, match=r"to_dcp\(src='.*/dcp'\): neither a checkpoint"):
        to_dcp(saved, tmp_path / "dcp3")


def _trained(opt_cls: type[torch.optim.Optimizer], **options: Any) -> dict[str, Any]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.BatchNorm1d(5))
    opt = opt_cls(model.parameters(), **options)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def _nested(levels: int) -> dict[str, Any]:
    tree: dict[str, Any] = {"leaf": torch.ones(2)}
    for i in range(levels):
        tree = {f"k{i}": tree, "l": [torch.zeros(1), i, "s"]}
    return tree


STATES: dict[str, Callable[[], dict[str, Any]]] = {
    "SGD with momentum": lambda: _trained(torch.optim.SGD, lr=0.1, momentum=0.9),
    "Adam amsgrad": lambda: _trained(torch.optim.Adam, amsgrad=True),
    "dtypes": lambda: {
        name: torch.arange(3).to(getattr(torch, name))
        for name in ("bfloat16", "float16", "float64", "complex64", "bool", "int8", "uint8")
    },
    "shapes and layouts": lambda: {
        "scalar": torch.tensor(3.0),
        "empty": torch.zeros(0, 5),
        "channels_last": torch.rand(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "transposed": torch.rand(4, 6).t(),
        "parameter": torch.nn.Parameter(torch.ones(3)),
    },
    "bytes entries": lambda: {
        "s": "text",
        "n": None,
        "f": 2.5,
        "t": (1, 2),
        "l": [1, "a", None],
        "d": {"x": {"y": 1}},
    },
    "nested 20 levels": lambda: _nested(20),
    "500 entries": lambda: {f"p{i}": torch.full((i % 5 + 1,), float(i)) for i in range(500)},
}
"""Real torch-written checkpoints: every one reads back exactly."""


@pytest.mark.parametrize("name", list(STATES))
def test_real_checkpoints_read_back_exactly(tmp_path: Path, name: str) -> None:
    state = STATES[name]()
    dcp.save(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
    assert read_metadata(tmp_path / "dcp") == _metadata(tmp_path / "dcp")  # pickle's own view
    back = read_dcp(tmp_path / "dcp")
    assert _same(back, state), name
    from_dcp(tmp_path / "dcp", tmp_path / "ph")  # and converts


def _same(a: Any, b: Any) -> bool:
    """Equal values (DCP keeps int keys as strings); tensors equal bit for bit, same dtype."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        keyed = {str(k): v for k, v in b.items()} if isinstance(b, dict) else {}
        return keyed.keys() == {str(k) for k in a} and all(
            _same(v, keyed[str(k)]) for k, v in a.items()
        )
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)
