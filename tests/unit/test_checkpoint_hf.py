"""phalanx <-> Hugging Face ``save_pretrained`` weights (hf_interop.py), bit-exact and sharded."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from phalanx import checkpoint
from phalanx.checkpoint import CheckpointError
from phalanx.checkpoint.hf_interop import INDEX, from_hf, to_hf

transformers = pytest.importorskip("transformers")


def _gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def test_export_loads_in_transformers_with_equal_logits_and_imports_back(tmp_path: Path) -> None:
    model = _gpt2()
    checkpoint.save(tmp_path / "ph", 5, model=model)
    to_hf(tmp_path / "ph", tmp_path / "hf", max_shard_bytes=20_000)
    model.config.save_pretrained(tmp_path / "hf")
    index = json.loads((tmp_path / "hf" / INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"]) == set(model.state_dict())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    from_hf(tmp_path / "hf", tmp_path / "back", step=5)
    fresh = transformers.GPT2LMHeadModel(model.config)
    checkpoint.load(tmp_path / "back", model=fresh, rng=False)
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_one_file_without_an_index_when_it_fits(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    checkpoint.save(tmp_path / "ph", 0, model=model)
    out = to_hf(tmp_path / "ph", tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    from_hf(out, tmp_path / "back")
    back = torch.nn.Linear(4, 3)
    checkpoint.load(tmp_path / "back", model=back, rng=False)
    assert torch.equal(back.weight, model.weight) and torch.equal(back.bias, model.bias)


def _exported(tmp_path: Path) -> Path:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    checkpoint.save(tmp_path / "ph", 0, model=model)
    return to_hf(tmp_path / "ph", tmp_path / "hf", max_shard_bytes=100)


def test_a_crafted_index_is_refused_naming_it(tmp_path: Path) -> None:
    hf = _exported(tmp_path)
    index = hf / INDEX
    doc = json.loads(index.read_text())
    doc["weight_map"]["0.weight"] = "../../etc/passwd"
    index.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"json: '\.\./\.\./etc/passwd' is not a plain"):
        from_hf(hf, tmp_path / "back")
    index.write_text("[" * 200 + "]" * 200)
    with pytest.raises(CheckpointError, match=r"index\.json: JSON nested deeper than 100"):
        from_hf(hf, tmp_path / "back")
    index.unlink()
    os.mkfifo(index)
    with pytest.raises(CheckpointError, match=r"index\.json: is a FIFO"):
        from_hf(hf, tmp_path / "back")
    assert not (tmp_path / "back").exists()


def test_a_file_that_disagrees_with_the_index_is_refused(tmp_path: Path) -> None:
    hf = _exported(tmp_path)
    doc = json.loads((hf / INDEX).read_text())
    doc["weight_map"]["1.bias"] = doc["weight_map"]["0.weight"]
    (hf / INDEX).write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"model-0000\d-of-0000\d\.safetensors: holds"):
        from_hf(hf, tmp_path / "back")
    with pytest.raises(ValueError, match=r"to_hf\(max_shard_bytes=0\)"):
        to_hf(tmp_path / "ph", tmp_path / "x", max_shard_bytes=0)


def test_a_missing_or_misnamed_shard_and_a_file_as_dst_are_named(tmp_path: Path) -> None:
    hf = _exported(tmp_path)
    doc = json.loads((hf / INDEX).read_text())
    first = sorted(set(doc["weight_map"].values()))[0]
    (hf / first).unlink()
    with pytest.raises(CheckpointError, match=rf"{first}: listed in .*index\.json, but cannot be "):
        from_hf(hf, tmp_path / "back")
    doc["weight_map"]["0.weight"] = "model\0.safetensors"
    (hf / INDEX).write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"index\.json: 'model\\x00\.safetensors' is not a"):
        from_hf(hf, tmp_path / "back")
    (tmp_path / "file").write_text("x")
    for convert in (to_hf, checkpoint.to_dcp):
        name = convert.__name__
        with pytest.raises(ValueError, match=rf"{name}\(dst='.*/file'\): dst must be a directory"):
            convert(tmp_path / "ph", tmp_path / "file")
    assert not (tmp_path / "back").exists() and (tmp_path / "file").read_text() == "x"


def test_the_command_line_converts_both_ways(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from phalanx.cli import main

    model = torch.nn.Linear(5, 2)
    checkpoint.save(tmp_path / "ph", 4, model=model)
    assert (
        main(["checkpoint", "convert", str(tmp_path / "ph"), str(tmp_path / "hf"), "--to", "hf"])
        == 0
    )
    assert (
        main(
            [
                "checkpoint",
                "convert",
                str(tmp_path / "hf"),
                str(tmp_path / "b"),
                "--from",
                "hf",
                "--step",
                "4",
            ]
        )
        == 0
    )
    assert (
        main(["checkpoint", "convert", str(tmp_path / "b"), str(tmp_path / "dcp"), "--to", "dcp"])
        == 0
    )
    assert (
        main(["checkpoint", "convert", str(tmp_path / "dcp"), str(tmp_path / "c"), "--from", "dcp"])
        == 0
    )
    back = torch.nn.Linear(5, 2)
    info = checkpoint.load(tmp_path / "c", model=back, rng=False)
    assert info is not None and torch.equal(back.weight, model.weight)
    assert (
        main(
            ["checkpoint", "convert", str(tmp_path / "nope"), str(tmp_path / "d"), "--from", "dcp"]
        )
        == 2
    )
    assert "from_dcp(src=" in capsys.readouterr().err
