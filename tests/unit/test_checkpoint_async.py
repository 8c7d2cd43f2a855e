"""``checkpoint.save(async_=True)``: a snapshot at call time, one write in flight, errors later."""

from __future__ import annotations

import errno
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from phalanx import checkpoint
from phalanx.checkpoint import atomic, background, staging


@pytest.fixture(autouse=True)
def _nothing_in_flight() -> Iterator[None]:
    yield
    try:
        checkpoint.wait()
    finally:
        staging.release()


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 8)).pow(2).mean().backward()
        opt.step()
    return model, opt


def _clone(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: _clone(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_clone(v) for v in state]
    return state


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_equal, a, b))
    return bool(a == b)


def test_what_is_written_is_the_state_at_save_time(tmp_path: Path) -> None:
    model, opt = _trained()
    before = _clone(model.state_dict()), _clone(opt.state_dict())
    returned = checkpoint.save(tmp_path, 2, model=model, optimizer=opt, async_=True)
    with torch.no_grad():  # training goes on in place while the write runs
        for p in model.parameters():
            p.mul_(-3.0).add_(1.0)
        for s in opt.state.values():
            s["exp_avg"].fill_(7.0)
    assert checkpoint.wait() == returned == tmp_path / "step-000002"
    fresh, fresh_opt = _trained()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    info = checkpoint.load(tmp_path, model=fresh, optimizer=fresh_opt)
    assert info is not None and info.step == 2
    assert _equal(fresh.state_dict(), before[0])
    assert _equal(fresh_opt.state_dict(), before[1])
    assert not _equal(model.state_dict(), before[0])  # the originals did change


def _hold_writes(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Every file write waits (up to 10 s) until the returned event is set."""
    release = threading.Event()
    write = atomic.write_file

    def held(path: Path, *args: Any, **kwargs: Any) -> Any:
        release.wait(10)
        return write(path, *args, **kwargs)

    monkeypatch.setattr(atomic, "write_file", held)
    return release


def test_save_returns_before_the_write_and_wait_returns_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = _hold_writes(monkeypatch)
    model, opt = _trained()
    checkpoint.save(tmp_path, 1, model=model, optimizer=opt, async_=True)
    assert background.in_flight() and not (tmp_path / "latest").exists()  # not written yet
    release.set()
    assert checkpoint.wait() == tmp_path / "step-000001"
    assert not background.in_flight() and checkpoint.latest(tmp_path) == tmp_path / "step-000001"
    assert checkpoint.wait() is None  # nothing in flight any more


def test_destroy_process_group_waits_for_the_write_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import phalanx

    release = _hold_writes(monkeypatch)
    phalanx.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1
    )
    model, opt = _trained()
    checkpoint.save(tmp_path / "ckpt", 1, model=model, optimizer=opt, async_=True)
    threading.Timer(0.3, release.set).start()
    phalanx.destroy_process_group()  # returns only once the write committed
    assert not background.in_flight()
    assert checkpoint.latest(tmp_path / "ckpt") == tmp_path / "ckpt" / "step-000001"


def test_the_next_save_and_load_wait_for_the_write_in_flight(tmp_path: Path) -> None:
    model, opt = _trained()
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, model=model, optimizer=opt, keep_last=2, async_=True)
        expected = _clone(model.state_dict()["0.weight"])
        with torch.no_grad():
            model.state_dict()["0.weight"].add_(1.0)
    fresh, _ = _trained()
    info = checkpoint.load(tmp_path, model=fresh)  # waits for step 3
    assert info is not None and info.step == 3
    assert torch.equal(fresh.state_dict()["0.weight"], expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000002", "step-000003"]


def test_staging_buffers_are_reused_while_shapes_match(tmp_path: Path) -> None:
    model, opt = _trained()
    checkpoint.save(tmp_path, 1, model=model, optimizer=opt, async_=True)
    checkpoint.wait()
    first = {k: b.data_ptr() for k, b in staging._BUFFERS.items()}
    assert staging.staged_bytes() >= sum(p.numel() * 4 * 3 for p in model.parameters())
    checkpoint.save(tmp_path, 2, model=model, optimizer=opt, async_=True)
    checkpoint.wait()
    assert {k: b.data_ptr() for k, b in staging._BUFFERS.items()} == first
    other = nn.Linear(3, 2)
    checkpoint.save(tmp_path, 3, model=other, async_=True)
    checkpoint.wait()
    assert staging._BUFFERS[("model", "weight", False)].shape == (2, 3)
    assert ("optimizer", "state.0.exp_avg", False) not in staging._BUFFERS  # dropped


def _no_space(fd: int, data: memoryview) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_failed_background_write_is_raised_by_wait_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _trained()
    checkpoint.save(tmp_path, 1, model=model, optimizer=opt)
    monkeypatch.setattr(atomic, "_write_all", _no_space)
    checkpoint.save(tmp_path, 2, model=model, optimizer=opt, async_=True)  # returns: staged
    with pytest.raises(checkpoint.CheckpointError) as caught:
        checkpoint.wait()
    message = str(caught.value)
    assert "checkpoint step 2 in" in message and "No space left on device" in message
    assert f"{tmp_path}/.tmp-step-000002-" in message and ".safetensors'" in message
    assert isinstance(caught.value.__cause__, OSError)
    assert checkpoint.latest(tmp_path) == tmp_path / "step-000001"  # the previous one holds
    assert [p.name for p in tmp_path.glob(".tmp-*")] == []  # rank 0 removed its temporary dir
    assert checkpoint.wait() is None  # raised once
    monkeypatch.undo()
    checkpoint.save(tmp_path, 3, model=model, async_=True)
    assert checkpoint.wait() == tmp_path / "step-000003"


def test_a_failed_background_write_is_raised_by_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _ = _trained()
    monkeypatch.setattr(atomic, "_write_all", _no_space)
    checkpoint.save(tmp_path, 1, model=model, async_=True)
    with pytest.raises(checkpoint.CheckpointError, match=r"step 1 .*No space.*\.safetensors'"):
        checkpoint.save(tmp_path, 2, model=model, async_=True)
    assert not background.in_flight()  # the save that raised started nothing
    monkeypatch.undo()
    checkpoint.save(tmp_path, 2, model=model, async_=True)
    assert checkpoint.wait() == tmp_path / "step-000002"


def test_a_state_that_cannot_be_stored_fails_at_once(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"dtype torch\.complex128"):
        checkpoint.save(
            tmp_path,
            1,
            model=model,
            objects={"z": torch.zeros(2, dtype=torch.complex128)},
            async_=True,
        )
    assert not background.in_flight() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["yes", 2, None])
def test_async_must_be_a_bool(tmp_path: Path, value: object) -> None:
    with pytest.raises(TypeError, match=r"save\(async_=.*\): async_ must be True or False, got"):
        checkpoint.save(tmp_path, 1, model=nn.Linear(2, 2), async_=value)  # type: ignore[arg-type]
    assert not background.in_flight()
