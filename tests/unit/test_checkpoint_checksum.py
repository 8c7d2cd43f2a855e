"""Checkpoint checksums: crc32c written and verified, a corrupt tensor named, sha256 still read.

Checkpoints written before crc32c (format ``phalanx-checkpoint/1``) record a sha256 per file;
:func:`_as_sha256_checkpoint` turns a checkpoint into exactly that (the data files of both
formats are the same bytes), and it must load, verify and name a corrupt file as before.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
from torch import nn

from phalanx import checkpoint
from phalanx.checkpoint import atomic
from phalanx.checkpoint import format as format_module
from phalanx.checkpoint.checksum import Digest, crc32c_combine, is_digest
from phalanx.checkpoint.format import encode


def _trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 16)).sum().backward()
    opt.step()
    return model, opt


def _manifest(step: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((step / "manifest.json").read_text())
    return doc


def _as_sha256_checkpoint(step: Path) -> None:
    """Rewrite ``step``'s manifest as phalanx-checkpoint/1 wrote it: a sha256 per file."""
    doc = _manifest(step)
    doc["format"] = "phalanx-checkpoint/1"
    doc["files"] = {
        name: {
            "bytes": entry["bytes"],
            "sha256": hashlib.sha256((step / name).read_bytes()).hexdigest(),
        }
        for name, entry in doc["files"].items()
    }
    (step / "manifest.json").write_text(json.dumps(doc, indent=1, sort_keys=True))


def _tensor_offset(path: Path, tensor: str) -> int:
    """Byte offset in the file ``path`` of the middle of ``tensor``'s data."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    begin, end = json.loads(raw[8 : 8 + n])[tensor]["data_offsets"]
    return 8 + n + (begin + end) // 2


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_the_manifest_records_crc32c_of_every_file_and_tensor(tmp_path: Path) -> None:
    model, opt = _trained()
    step = checkpoint.save(tmp_path, 1, model=model, optimizer=opt)
    doc = _manifest(step)
    assert doc["format"] == "phalanx-checkpoint/2"
    for name, entry in doc["files"].items():
        digest = Digest("crc32c")
        digest.update((step / name).read_bytes())
        assert entry["crc32c"] == digest.hexdigest() and "sha256" not in entry, name
    weights = doc["files"]["model.safetensors"]["tensors"]
    assert sorted(weights) == sorted(model.state_dict())
    assert all(is_digest("crc32c", d) for d in weights.values())


@pytest.fixture(params=["cached", "cold"])
def read_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Files checked as mapped (in the page cache) or as streamed (cold): both must catch it."""
    cached = request.param == "cached"
    monkeypatch.setattr(format_module, "_cached", lambda fd, size: cached)
    return str(request.param)


def test_both_ways_of_reading_load_the_same_values(tmp_path: Path, read_path: str) -> None:
    model, opt = _trained()
    checkpoint.save(tmp_path, 1, model=model, optimizer=opt)
    fresh, fresh_opt = _trained(1)
    checkpoint.load(tmp_path, model=fresh, optimizer=fresh_opt)
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), (read_path, k)


@pytest.mark.parametrize("tensor", ["0.weight", "2.bias"])
def test_a_flipped_byte_in_a_tensor_is_named_with_its_file(
    tmp_path: Path, tensor: str, read_path: str
) -> None:
    model, opt = _trained()
    step = checkpoint.save(tmp_path, 1, model=model, optimizer=opt)
    path = step / "model.safetensors"
    _flip(path, _tensor_offset(path, tensor))
    with pytest.raises(checkpoint.ChecksumError) as err:
        checkpoint.load(tmp_path, model=_trained(1)[0])
    message = str(err.value)
    assert str(path) in message and f"corrupt: tensor(s) {tensor})" in message, message


def test_a_flipped_byte_in_a_header_is_a_checksum_error(tmp_path: Path, read_path: str) -> None:
    model, _ = _trained()
    step = checkpoint.save(tmp_path, 1, model=model)
    path = step / "model.safetensors"
    _flip(path, 12)  # inside the JSON header: corrupt, not crafted
    with pytest.raises(checkpoint.ChecksumError, match=r"model\.safetensors: crc32c is"):
        checkpoint.load(tmp_path, model=_trained(1)[0])


def test_a_sha256_checkpoint_written_before_loads_and_verifies(tmp_path: Path) -> None:
    model, opt = _trained()
    step = checkpoint.save(tmp_path, 5, model=model, optimizer=opt, extra={"k": 1})
    _as_sha256_checkpoint(step)
    other, other_opt = _trained(1)
    info = checkpoint.load(tmp_path, model=other, optimizer=other_opt)
    assert info is not None and info.step == 5 and info.extra == {"k": 1}
    for k, v in model.state_dict().items():
        assert torch.equal(other.state_dict()[k], v), k
    assert torch.equal(
        other_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]
    )
    path = step / "optimizer.safetensors"
    _flip(path, path.stat().st_size - 3)
    recorded = _manifest(step)["files"]["optimizer.safetensors"]["sha256"]
    with pytest.raises(checkpoint.ChecksumError) as err:
        checkpoint.load(tmp_path, model=other, optimizer=other_opt)
    assert str(path) in str(err.value) and "sha256 is" in str(err.value)
    assert recorded in str(err.value)


def test_an_unknown_checksum_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="algo='md5'"):
        Digest("md5")


@pytest.mark.parametrize(("n1", "n2"), [(0, 7), (7, 0), (1, 1), (1000, 12345), (3, 2**20 + 5)])
def test_crc32c_combine_equals_the_crc_of_the_concatenation(n1: int, n2: int) -> None:
    gen = torch.Generator().manual_seed(n1 + n2)
    data = torch.randint(0, 256, (n1 + n2,), dtype=torch.uint8, generator=gen).numpy().tobytes()
    a, b = data[:n1], data[n1:]
    assert crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), n2) == crc32c.crc32c(data)
    with pytest.raises(ValueError, match="len2 must be >= 0, got -1"):
        crc32c_combine(0, 0, -1)


def test_large_tensors_are_checksummed_once_and_still_exactly(tmp_path: Path) -> None:
    """Chunks of big tensors are checksummed once and combined into the file's and the
    tensor's crc32c; both must equal a crc32c of the bytes on disk."""
    tensors = {"big": torch.randn(9 * 2**18 + 3), "mid": torch.randn(2**17), "small": torch.ones(5)}
    entry = atomic.write_file(tmp_path / "f.safetensors", encode(tensors))
    raw = (tmp_path / "f.safetensors").read_bytes()
    assert entry.digest == f"{crc32c.crc32c(raw):08x}"
    assert entry.tensors is not None
    for name, t in tensors.items():
        assert entry.tensors[name] == f"{crc32c.crc32c(t.numpy().tobytes()):08x}", name


def test_a_file_evicted_from_the_page_cache_is_seen_as_cold(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * (1 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert format_module._cached(fd, 1 << 20)  # just written
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if format_module._cached(fd, 1 << 20):
            pytest.skip("this filesystem keeps the file cached (tmpfs?)")
    finally:
        os.close(fd)
