"""phalanx <-> torch DCP at 2 ranks and at another world size: bit-exact model and AdamW state.

- A ZeRO optimizer saved by 2 ranks (per-rank pieces) goes to DCP; torch's own ``dcp.load`` at
  2 ranks into a plain model and AdamW gives exactly what phalanx's ``load`` gives at 1 rank,
  and ``from_dcp`` brings it back unchanged.
- A DCP checkpoint saved by 2 ranks (``get_state_dict`` layout) comes into phalanx, loads at 1
  rank bit-exactly, and goes back to DCP with every entry equal to the original's.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import phalanx
from phalanx import checkpoint
from phalanx.checkpoint.dcp_interop import from_dcp, read_dcp, to_dcp
from phalanx.sharding import ZeroRedundancyOptimizer
from phalanx.testing import run_distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3))


def _train(opt: torch.optim.Optimizer, model: nn.Module) -> None:
    for step in range(3):  # the same data on every rank: no gradient averaging needed
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _save_zero(directory: str) -> None:
    torch.set_num_threads(1)
    model = _model()
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01)
    _train(opt, model)
    checkpoint.save(directory, 3, model=model, optimizer=opt)


def _plain(directory: Path) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)  # lr and state come from the file
    checkpoint.load(directory, model=model, optimizer=opt, rng=False)
    return model, opt


def _dcp_load(directory: str) -> bytes:
    torch.set_num_threads(1)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    ms, os_ = get_state_dict(model, opt)
    state = {"model": ms, "optimizer": os_}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return pickle.dumps((model.state_dict(), opt.state_dict()))


def _same(a: Any, b: Any) -> bool:
    """Equal values, and tensors equal bit for bit with the same dtype and shape."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def test_zero_at_2_to_dcp_loads_in_torch_at_2_and_back_at_1(tmp_path: Path) -> None:
    run_distributed(_save_zero, str(tmp_path / "ph"), world_size=2, timeout=60)
    assert len(list((tmp_path / "ph").glob("step-*/optimizer-shard-*.json"))) == 2
    model, opt = _plain(tmp_path / "ph")  # phalanx's own reshard to 1 rank: the reference
    assert opt.state_dict()["state"][0]["step"] == 3
    names = [n for n, _ in model.named_parameters()]
    to_dcp(tmp_path / "ph", tmp_path / "dcp", param_names=names)
    loaded = run_distributed(_dcp_load, str(tmp_path / "dcp"), world_size=2, timeout=60)
    for raw in loaded:
        theirs_model, theirs_opt = pickle.loads(raw)
        assert _same(theirs_model, model.state_dict())
        assert _same(theirs_opt, opt.state_dict())
    from_dcp(tmp_path / "dcp", tmp_path / "back", step=3)
    model2, opt2 = _plain(tmp_path / "back")
    assert _same(model2.state_dict(), model.state_dict())
    assert _same(opt2.state_dict(), opt.state_dict())


def _dcp_save(directory: str) -> bytes:
    torch.set_num_threads(1)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    _train(opt, model)
    ms, os_ = get_state_dict(model, opt)
    dcp.save({"model": ms, "optimizer": os_}, checkpoint_id=directory)
    return pickle.dumps((model.state_dict(), opt.state_dict()))


def test_dcp_at_2_to_phalanx_at_1_and_back_to_dcp(tmp_path: Path) -> None:
    saved = run_distributed(_dcp_save, str(tmp_path / "dcp"), world_size=2, timeout=60)
    reference, reference_opt = pickle.loads(saved[0])  # what the ranks trained
    assert len(list((tmp_path / "dcp").glob("*.distcp"))) == 2
    from_dcp(tmp_path / "dcp", tmp_path / "ph", step=7)
    model, opt = _plain(tmp_path / "ph")
    assert _same(model.state_dict(), reference)
    assert _same(opt.state_dict(), reference_opt)
    to_dcp(tmp_path / "ph", tmp_path / "again")  # names recorded by from_dcp
    assert _same(read_dcp(tmp_path / "again"), read_dcp(tmp_path / "dcp"))
    assert phalanx.checkpoint.latest(tmp_path / "ph") is not None
