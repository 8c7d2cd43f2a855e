"""Nothing from a checkpoint runs code or escapes its directory; corruption is named, fast."""

from __future__ import annotations

import json
import os
import pickle
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from phalanx import checkpoint


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _big_model() -> nn.Module:
    return nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512))  # ~4 MB of float32


def _saved(tmp_path: Path) -> tuple[nn.Module, torch.optim.Optimizer, Path]:
    model = _big_model()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    return model, opt, checkpoint.save(tmp_path, 7, model=model, optimizer=opt)


@pytest.mark.parametrize(
    "name",
    ["model.safetensors", "optimizer.safetensors", "rank-00000.safetensors", "optimizer.json"],
)
def test_a_flipped_byte_is_named_within_two_seconds(tmp_path: Path, name: str) -> None:
    model, opt, path = _saved(tmp_path)
    target = path / name
    data = bytearray(target.read_bytes())
    data[len(data) * 2 // 3] ^= 0x10
    target.write_bytes(bytes(data))
    start = time.monotonic()
    with pytest.raises(checkpoint.ChecksumError) as err:
        checkpoint.load(tmp_path, model=model, optimizer=opt)
    assert time.monotonic() - start < 2.0
    recorded = json.loads((path / "manifest.json").read_text())["files"][name]["crc32c"]
    assert str(target) in str(err.value) and recorded in str(err.value)


def test_a_truncated_file_is_named(tmp_path: Path) -> None:
    model, _, path = _saved(tmp_path)
    with open(path / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(checkpoint.ChecksumError, match=r"model\.safetensors: 1000 bytes on disk"):
        checkpoint.load(tmp_path, model=model)


def _edit_manifest(path: Path, entry: str) -> None:
    doc = json.loads((path / "manifest.json").read_text())
    doc["files"][entry] = {"sha256": "0" * 64, "bytes": 1}
    (path / "manifest.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("entry", ["/etc/passwd", "../model.safetensors", "sub/../../x", "a\\b"])
def test_manifest_entries_cannot_escape(tmp_path: Path, entry: str) -> None:
    model, _, path = _saved(tmp_path)
    _edit_manifest(path, entry)
    with pytest.raises(checkpoint.CheckpointError, match="entry") as err:
        checkpoint.load(tmp_path, model=model)
    assert repr(entry) in str(err.value)


def test_symlink_pointing_outside_is_refused(tmp_path: Path) -> None:
    model, _, path = _saved(tmp_path / "ckpt")
    outside = tmp_path / "outside.safetensors"
    os.replace(path / "model.safetensors", outside)
    os.symlink(outside, path / "model.safetensors")
    with pytest.raises(checkpoint.CheckpointError, match=r"'model\.safetensors' is a symlink"):
        checkpoint.load(tmp_path / "ckpt", model=model)


def test_latest_pointer_cannot_escape(tmp_path: Path) -> None:
    _, _, path = _saved(tmp_path)
    (tmp_path / "latest").write_text("../../etc\n")
    assert checkpoint.latest(tmp_path) == path  # ignored (logged), falls back to the scan


def test_load_never_unpickles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, _ = _saved(tmp_path)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("unpickling during checkpoint.load")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    info = checkpoint.load(tmp_path, model=model, optimizer=opt)
    assert info is not None and info.step == 7


def test_import_torch_state_dict(tmp_path: Path) -> None:
    model = _big_model()
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    state = checkpoint.import_torch_state_dict(tmp_path / "sd.pt")
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    torch.save({"model": model.state_dict(), "epoch": 3}, tmp_path / "full.pt")
    assert (
        checkpoint.import_torch_state_dict(tmp_path / "full.pt", key="model").keys() == state.keys()
    )
    with pytest.raises(TypeError, match="entry 'model' is a OrderedDict, not a tensor"):
        checkpoint.import_torch_state_dict(tmp_path / "full.pt")


@pytest.mark.parametrize("force_unsafe", ["", "1"])
@pytest.mark.parametrize("container", ["zip", "legacy"])
def test_a_malicious_pickle_does_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, force_unsafe: str, container: str
) -> None:
    marker = tmp_path / "MARKER"
    evil = tmp_path / "evil.pt"
    if container == "zip":
        torch.save({"w": torch.ones(2), "x": _Evil(marker)}, evil)
    else:
        evil.write_bytes(pickle.dumps({"x": _Evil(marker)}, protocol=2))
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", force_unsafe)
    with pytest.raises(pickle.UnpicklingError, match=r"evil\.pt: refused to unpickle"):
        checkpoint.import_torch_state_dict(evil)
    assert not marker.exists()
