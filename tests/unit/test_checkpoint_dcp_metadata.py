"""DCP's pickled ``.metadata`` is read without running code and within bounds (dcp_metadata.py)."""

from __future__ import annotations

import dataclasses
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as md

from phalanx.checkpoint import CheckpointError
from phalanx.checkpoint.dcp_interop import from_dcp, read_dcp, to_dcp

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
