"""Replicated state written by every rank, each a share (``checkpoint/spread.py``), on 2 ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import phalanx
from phalanx import checkpoint
from phalanx.checkpoint import sections, spread
from phalanx.testing import run_distributed


def _model(seed: int, width: int = 1024) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, 8))


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    moments = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    return [*model.state_dict().values(), *moments]


def _save(directory: str, seed_by_rank: bool, width_by_rank: bool, equal: bool) -> Any:
    """Save a model (8 MiB: two files at 2 ranks) and its AdamW state, recording which files
    this rank wrote; load it back into fresh objects unless the layouts differ by rank."""
    from phalanx.checkpoint import atomic

    rank = phalanx.world().rank
    wrote: list[str] = []
    write = atomic.write_file

    def record(path: Path, *args: Any, **kwargs: Any) -> Any:
        wrote.append(path.name)
        return write(path, *args, **kwargs)

    atomic.write_file = record
    model = _model(rank if seed_by_rank else 0, 1024 + 8 * rank if width_by_rank else 1024)
    optimizer = torch.optim.AdamW(model.parameters())
    width = int(model[0].in_features)
    model(torch.ones(2, width)).sum().backward()
    optimizer.step()
    checkpoint.save(directory, 1, model=model, optimizer=optimizer, replicas_equal=equal)
    if width_by_rank:
        return sorted(wrote), _state(model, optimizer), None
    fresh = _model(99)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    checkpoint.load(directory, model=fresh, optimizer=fresh_opt)
    return sorted(wrote), _state(model, optimizer), _state(fresh, fresh_opt)


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _tensor_files(wrote: list[str]) -> set[str]:
    return {f for f in wrote if f.startswith(("model", "optimizer")) and f.endswith(".safetensors")}


def test_every_rank_writes_a_share_and_the_load_is_exact(tmp_path: Path) -> None:
    (w0, own0, got0), (w1, own1, got1) = run_distributed(
        _save, str(tmp_path), False, False, True, world_size=2
    )
    assert _tensor_files(w0) and _tensor_files(w1)  # both wrote a share
    assert not _tensor_files(w0) & _tensor_files(w1)  # no file twice
    assert {"model.json", "optimizer.json", "manifest.json"} <= set(w0)
    assert not {"model.json", "optimizer.json", "manifest.json"} & set(w1)
    assert _equal(own0, own1) and _equal(got0, own0) and _equal(got1, own0)


def test_ranks_with_other_layouts_leave_rank_0_writing_alone(tmp_path: Path) -> None:
    (w0, own0, _), (w1, _, _) = run_distributed(
        _save, str(tmp_path), False, True, True, world_size=2
    )
    assert _tensor_files(w0)
    assert [f for f in w1 if not f.startswith("rank-")] == []
    fresh = _model(99)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    checkpoint.load(tmp_path, model=fresh, optimizer=fresh_opt)
    assert _equal(_state(fresh, fresh_opt), own0)


def test_replicas_equal_false_writes_rank_0s_values(tmp_path: Path) -> None:
    """Ranks whose values differ (same layout): the checkpoint is rank 0's copy, whole."""
    (w0, own0, got0), (w1, own1, got1) = run_distributed(
        _save, str(tmp_path), True, False, False, world_size=2
    )
    assert _tensor_files(w0) and [f for f in w1 if not f.startswith("rank-")] == []
    assert not _equal(own0, own1)
    assert _equal(got0, own0) and _equal(got1, own0)


def test_deal_balances_the_bytes_and_covers_every_file() -> None:
    sizes = [("a", 50), ("b", 40), ("c", 30), ("d", 20), ("e", 10)]
    owner = spread.deal(sizes, 2)
    assert set(owner) == {name for name, _ in sizes}
    load = [sum(size for name, size in sizes if owner[name] == r) for r in range(2)]
    assert sorted(load) == [70, 80]
    assert owner["a"] == 1  # ties go to the highest rank (rank 0 also commits)
    assert spread.deal(sizes, 1) == dict.fromkeys(owner, 0)


def test_share_splits_a_section_into_a_part_per_rank() -> None:
    tensors = {f"t{i}": torch.zeros(sections.MIN_PART_BYTES // 4) for i in range(4)}
    section = sections.Section("model", {}, tensors)
    shares = [spread.share([section], rank, 4) for rank in range(4)]
    files = [name for s in shares for name, _ in s.tensor_files]
    assert len(files) == len(set(files)) == 4
    held = [k for s in shares for _, part in s.tensor_files for k in part.tensors]
    assert sorted(held) == sorted(tensors)
    assert [name for name, _ in shares[0].indexes] == ["model.json"]
    assert all(not s.indexes and not s.sections for s in shares[1:])
    small = sections.Section("model", {}, {"t": torch.zeros(8)})
    assert len(small.tensor_files(parts=4)) == 1  # not split below MIN_PART_BYTES


def test_replicas_equal_is_checked(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="replicas_equal"):
        checkpoint.save(tmp_path, 1, model=nn.Linear(2, 2), replicas_equal="yes")  # type: ignore[arg-type]
