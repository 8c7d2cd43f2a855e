"""Save and load in one process: bit-identical resume, mismatches, keep-last-k, fallbacks."""

from __future__ import annotations

import copy
import json
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from phalanx import checkpoint


class Sampler:
    """A sampler-like object: position in the epoch."""

    def __init__(self) -> None:
        self.epoch, self.position = 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


class Wrapper(nn.Module):
    """Stands for DDP / DataParallel: the real model is ``.module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 12), nn.Dropout(0.2), nn.Tanh(), nn.Linear(12, 3))


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-2, amsgrad=True)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _setup(kind: str) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    model = _net()
    opt = _optimizer(kind, model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _train(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 6)  # draws from the RNG: resumed runs must draw the same
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return [*losses, random.random(), float(np.random.rand())]


@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd"])
def test_resume_continues_bit_identically(tmp_path: Path, kind: str) -> None:
    torch.manual_seed(0)
    model, opt, sched = _setup(kind)
    _train(model, opt, sched, 3)
    sampler = Sampler()
    sampler.epoch, sampler.position = 2, 17
    extra = {"epoch": 2, "losses": [0.5, 0.25], "pair": (1, 2)}
    checkpoint.save(
        tmp_path,
        3,
        model=Wrapper(model),
        optimizer=opt,
        scheduler=sched,
        sampler=sampler,
        extra=extra,
    )
    saved = copy.deepcopy(opt.state_dict())
    expected = _train(model, opt, sched, 4)
    final = {k: v.clone() for k, v in model.state_dict().items()}

    model2, opt2, sched2 = _setup(kind)
    sampler2 = Sampler()
    info = checkpoint.load(
        tmp_path, model=Wrapper(model2), optimizer=opt2, scheduler=sched2, sampler=sampler2
    )
    assert info is not None and info.step == 3 and info.world_size == 1 and info.notes == ()
    assert info.extra == extra and info.path == tmp_path.absolute() / "step-000003"
    assert (sampler2.epoch, sampler2.position) == (2, 17)
    restored = opt2.state_dict()
    assert restored["param_groups"] == saved["param_groups"]
    for index, state in saved["state"].items():  # Adam's step tensors, SGD's momentum buffers
        for key, value in state.items():
            got = restored["state"][index][key]
            assert type(got) is type(value) and torch.equal(torch.as_tensor(got), value), key
    assert _train(model2, opt2, sched2, 4) == expected
    for k, v in model2.state_dict().items():
        assert torch.equal(v, final[k]), k


def test_layout_is_safetensors_plus_json_and_step_tensors_are_kept(tmp_path: Path) -> None:
    model, opt, sched = _setup("adamw")
    _train(model, opt, sched, 1)
    path = checkpoint.save(tmp_path, 1, model=model, optimizer=opt, scheduler=sched)
    names = sorted(p.name for p in path.iterdir())
    assert names == [
        "manifest.json",
        "model.json",
        "model.safetensors",
        "optimizer.json",
        "optimizer.safetensors",
        "rank-00000.json",
        "rank-00000.safetensors",
        "scheduler.json",
    ]
    doc = json.loads((path / "optimizer.json").read_text())
    assert doc["tensor_files"] == ["optimizer.safetensors"]
    assert doc["state"]["state"]["__items__"][0][1]["step"] == {"__tensor__": "state.0.step"}
    assert (tmp_path / "latest").read_text() == "step-000001\n"
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["files"]) == set(names) - {"manifest.json"}


class HasModule(nn.Module):
    """Not a wrapper: a submodule that happens to be called ``module``, plus a head."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(3, 3)
        self.head = nn.Linear(3, 1)


def test_only_real_wrappers_are_unwrapped(tmp_path: Path) -> None:
    path = checkpoint.save(tmp_path, 1, model=HasModule())
    keys = set(json.loads((path / "model.json").read_text())["state"])
    assert keys == {"module.weight", "module.bias", "head.weight", "head.bias"}
    path = checkpoint.save(tmp_path, 2, model=Wrapper(Wrapper(nn.Linear(2, 2))))
    assert set(json.loads((path / "model.json").read_text())["state"]) == {"weight", "bias"}


def test_nothing_committed_gives_none(tmp_path: Path) -> None:
    assert checkpoint.load(tmp_path / "absent", model=_net()) is None
    assert checkpoint.latest(tmp_path) is None


def test_large_sections_are_split_into_parallel_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from phalanx.checkpoint import sections

    monkeypatch.setattr(sections, "SHARD_BYTES", 1000)
    model = nn.Sequential(nn.Linear(10, 20), nn.Linear(20, 20), nn.Linear(20, 5))
    path = checkpoint.save(tmp_path, 1, model=model)
    shards = sorted(p.name for p in path.glob("model*.safetensors"))
    assert shards == ["model-00001.safetensors", "model-00002.safetensors", "model.safetensors"]
    fresh = nn.Sequential(nn.Linear(10, 20), nn.Linear(20, 20), nn.Linear(20, 5))
    checkpoint.load(tmp_path, model=fresh)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))


def test_keep_last_leaves_exactly_k(tmp_path: Path) -> None:
    model = _net()
    for step in range(0, 60, 10):
        checkpoint.save(tmp_path, step, model=model, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000040", "step-000050"]
    checkpoint.save(tmp_path, 60, model=model, keep_last=None)
    assert len(list(tmp_path.glob("step-*"))) == 3
    with pytest.raises(ValueError, match="keep_last"):
        checkpoint.save(tmp_path, 70, model=model, keep_last=0)


def test_mismatched_model_lists_missing_unexpected_and_shapes(tmp_path: Path) -> None:
    saved = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 2))
    checkpoint.save(tmp_path, 1, model=saved)
    other = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2), nn.Linear(2, 2))
    with pytest.raises(checkpoint.StateMismatchError) as err:
        checkpoint.load(tmp_path, model=other)
    text = str(err.value)
    assert "model.safetensors" in text and "missing in the checkpoint (2): 2.weight, 2.bias" in text
    assert "0.weight: checkpoint (5, 4), model (6, 4)" in text and "1.weight" in text
    smaller = nn.Sequential(nn.Linear(4, 5))
    with pytest.raises(checkpoint.StateMismatchError, match=r"unexpected .*\(2\): 1.weight"):
        checkpoint.load(tmp_path, model=smaller)

    with pytest.warns(UserWarning, match="shape mismatch") as rec:
        checkpoint.load(tmp_path, model=other, strict=False)
    assert "Loaded the 1 matching entries" in str(rec[0].message)
    assert torch.equal(other.state_dict()["1.bias"], saved.state_dict()["1.bias"])  # it fits


def test_scheduler_that_is_not_json_able_names_the_key(tmp_path: Path) -> None:
    model, opt, _ = _setup("sgd")

    class Sched:
        def state_dict(self) -> dict[str, Any]:
            return {"last_epoch": 3, "fn": {"f": print}}

    with pytest.raises(TypeError, match=r"scheduler state key 'fn\.f'"):
        checkpoint.save(tmp_path, 1, model=model, optimizer=opt, scheduler=Sched())
    assert list(tmp_path.iterdir()) == []  # the temporary directory is removed


def test_missing_section_is_an_error_unless_not_strict(tmp_path: Path) -> None:
    model, opt, _ = _setup("sgd")
    checkpoint.save(tmp_path, 1, model=model)
    with pytest.raises(checkpoint.CheckpointError, match="holds no optimizer state"):
        checkpoint.load(tmp_path, model=model, optimizer=opt)
    with pytest.warns(UserWarning, match="optimizer not restored"):
        checkpoint.load(tmp_path, model=model, optimizer=opt, strict=False)


def test_leftover_temporary_directory_is_skipped_with_a_warning(tmp_path: Path) -> None:
    model = _net()
    checkpoint.save(tmp_path, 1, model=model)
    leftover = tmp_path / ".tmp-step-000002-deadbeef"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"partial")
    incomplete = tmp_path / "step-000003"
    incomplete.mkdir()
    with pytest.warns(UserWarning) as rec:
        info = checkpoint.load(tmp_path, model=model)
    messages = " ".join(str(w.message) for w in rec)
    assert str(leftover) in messages and str(incomplete) in messages
    assert info is not None and info.step == 1
    checkpoint.save(tmp_path, 4, model=model)  # a later save removes the leftover
    assert not leftover.exists()


def test_without_latest_the_newest_verified_checkpoint_is_used(tmp_path: Path) -> None:
    model = _net()
    checkpoint.save(tmp_path, 1, model=model)
    checkpoint.save(tmp_path, 2, model=model)
    (tmp_path / "latest").unlink()
    assert checkpoint.latest(tmp_path) == tmp_path / "step-000002"
    data = bytearray((tmp_path / "step-000002" / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (tmp_path / "step-000002" / "model.safetensors").write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="skipping checkpoint .*step-000002"):
        assert checkpoint.latest(tmp_path) == tmp_path / "step-000001"
    (tmp_path / "latest").write_text("step-000009\n")
    with pytest.warns(UserWarning) as rec:
        assert checkpoint.latest(tmp_path) == tmp_path / "step-000001"
    messages = [str(w.message) for w in rec]
    assert "names step-000009, which is missing" in messages[0] and "step-000002" in messages[1]


def test_saving_the_same_step_again_replaces_it(tmp_path: Path) -> None:
    model = _net()
    checkpoint.save(tmp_path, 5, model=model)
    with torch.no_grad():
        model.state_dict()["0.weight"].fill_(1.5)
    checkpoint.save(tmp_path, 5, model=model)
    fresh = _net()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checkpoint.load(tmp_path, model=fresh)
    assert torch.equal(fresh.state_dict()["0.weight"], model.state_dict()["0.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000005"]


def test_explicit_path_loads_an_older_checkpoint(tmp_path: Path) -> None:
    model = _net()
    first = checkpoint.save(tmp_path, 1, model=model, extra={"tag": "one"})
    checkpoint.save(tmp_path, 2, model=model, extra={"tag": "two"})
    info = checkpoint.load(tmp_path, model=model, path=first)
    assert info is not None and info.extra == {"tag": "one"}
    info = checkpoint.load(tmp_path, model=model, path="step-000001")
    assert info is not None and info.path == first
    with pytest.raises(checkpoint.CheckpointError, match=r"manifest\.json: missing"):
        checkpoint.load(tmp_path, model=model, path=tmp_path / "nope")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_model_optimizer_and_generator(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _net().cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6, device="cuda")).sum().backward()
    opt.step()
    checkpoint.save(tmp_path, 1, model=model, optimizer=opt)
    expected = torch.rand(3, device="cuda")
    fresh = _net().cuda()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    info = checkpoint.load(tmp_path, model=fresh, optimizer=fresh_opt)
    assert info is not None and info.notes == ()
    assert torch.equal(torch.rand(3, device="cuda"), expected)
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    assert fresh_opt.state_dict()["state"][0]["exp_avg"].device.type == "cuda"
