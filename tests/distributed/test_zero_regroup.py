"""``regroup()`` of ZeRO-1/2 and ZeRO-3: the same objects, re-sharded over a new default group.

Live recovery replaces the default group when ranks are lost or join, and every survivor holds
the full state (recovered from a neighbour's copy). Four ranks train, rank 3 leaves, the other
three rebuild the default group and call ``regroup(full_state=...)`` on the objects they hold;
two more steps must give the bits of a fresh optimizer (or FSDP) built at three ranks over the
same full state. Growth (3 -> 4, the new rank building its optimizer before it joins) too.
"""

from __future__ import annotations

import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from phalanx.sharding import ZeroRedundancyOptimizer
from phalanx.sharding.zero3 import FullyShardedDataParallel
from phalanx.testing import run_distributed

NO_CHECK = {"PHALANX_MISMATCH_CHECK": "0"}
"""For growth: the always-on mismatch check numbers each rank's calls per group name from the
process's first group on, and every default group is named "0"; rank 3 sat out the group of
three, so its numbers lag the others' and the check compares unrelated calls (a false
CollectiveMismatchError, seen in 4 of 12 runs on this box)."""
CAP = 0.0001  # MiB: about 26 floats a bucket, so ranges split parameters across buckets


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)


def _loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = _batch(step, rank)
    return nn.functional.mse_loss(model(x), y)


def _zero(model: nn.Module, stage: int) -> ZeroRedundancyOptimizer:
    return ZeroRedundancyOptimizer(
        model.parameters(),
        torch.optim.Adam,
        parameters_as_bucket_view=stage == 2,
        stage=stage,
        bucket_cap_mb=CAP,
        lr=0.01,
    )


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        opt.zero_grad(set_to_none=True)
        _loss(model, step, dist.get_rank()).backward()
        opt.step()


def _full_state(opt: ZeroRedundancyOptimizer) -> dict[str, Any]:
    """The whole optimizer state on every rank (what peer recovery hands each survivor)."""
    out: dict[str, Any] = {}
    for to in range(dist.get_world_size()):
        opt.consolidate_state_dict(to)
        if dist.get_rank() == to:
            out = opt.state_dict()
    return out


def _new_group(folder: str, name: str, rank: int, world: int) -> None:
    store = dist.FileStore(str(Path(folder) / name), world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )


def _join_four(folder: str, rank: int, model_sd: Any, full: Any) -> tuple[dict, dict]:
    """All four ranks form the next group; rank 0's full states reach every rank (this stands
    in for the peer recovery's hand-over)."""
    _new_group(folder, "g4", rank, 4)
    shared = [model_sd, full]
    dist.broadcast_object_list(shared, src=0)
    assert shared[0] is not None and shared[1] is not None
    return shared[0], shared[1]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _check_grads(model: nn.Module, opt: ZeroRedundancyOptimizer, step: int) -> float:
    """Backward once; the largest error of this rank's reduced gradient ranges against the
    average of every rank's gradient computed here (twice the average if reduced twice)."""
    params = list(model.parameters())
    world = dist.get_world_size()
    grads = [torch.autograd.grad(_loss(model, step, r), params) for r in range(world)]
    expected = [torch.stack([g[i] for g in grads]).sum(0) / world for i in range(len(params))]
    opt.zero_grad(set_to_none=True)
    _loss(model, step, dist.get_rank()).backward()
    opt.owned_grads()
    err = 0.0
    for mine in opt.owned:
        for r in mine:
            assert r.tensor.grad is not None, r
            want = r.view_of(expected[r.param])
            err = max(err, (r.tensor.grad - want.reshape(r.tensor.shape)).abs().max().item())
    return err


def _after_regroup(
    model: nn.Module, opt: ZeroRedundancyOptimizer, stage: int, full: dict, model_sd: dict
) -> dict[str, Any]:
    """Two steps on the new group (the first checking its gradients), then the reference."""
    err = _check_grads(model, opt, 3)
    opt.step()
    _train(model, opt, range(4, 5))
    hooks = [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()]
    params, state = [p.detach().clone() for p in model.parameters()], _full_state(opt)
    ref_model = _model()
    ref_model.load_state_dict(model_sd)
    ref = _zero(ref_model, stage)
    ref.load_state_dict(full)
    _train(ref_model, ref, range(3, 5))
    return {
        "grad_err": err,
        "hooks": hooks,
        "params": _same(params, [p.detach() for p in ref_model.parameters()]),
        "state": _same(state, _full_state(ref)),
        "moved": not _same(params, list(model_sd.values())),
        "ranges": sum(len(m) for m in opt.owned),
    }


def _shrink(folder: str, stage: int) -> dict[str, Any] | None:
    rank = dist.get_rank()
    model = _model()
    opt = _zero(model, stage)
    ident, param_ids = id(opt), [id(p) for p in model.parameters()]
    _train(model, opt, range(3))
    full = _full_state(opt)
    model_sd = {k: v.clone() for k, v in model.state_dict().items()}
    dist.destroy_process_group()
    if rank == 3:  # lost
        return None
    _new_group(folder, "g3", rank, 3)
    opt.regroup(full_state=full)
    out = _after_regroup(model, opt, stage, full, model_sd)
    out["same_object"] = id(opt) == ident and [id(p) for p in model.parameters()] == param_ids
    out["world"] = opt.world
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_regroup_after_a_lost_rank_matches_a_fresh_optimizer(stage: int) -> None:
    folder = tempfile.mkdtemp(prefix="phalanx-zero-regroup-")
    results = run_distributed(_shrink, folder, stage, world_size=4, timeout=90, may_die=(3,))
    assert results[3] is None
    for out in results[:3]:
        assert out is not None
        assert out["same_object"] and out["world"] == 3
        assert out["grad_err"] < 1e-6, out["grad_err"]  # reduced once, over the three
        assert out["hooks"] == [1 if stage == 2 else 0] * 4  # the old reducer's hooks are gone
        assert out["moved"] and out["params"] and out["state"], out
    assert sum(out["ranges"] for out in results[:3] if out) >= 4  # every parameter is owned


def _grow(folder: str) -> dict[str, Any]:
    rank = dist.get_rank()
    dist.barrier()  # every rank's connections are up before one tears its group down
    dist.destroy_process_group()
    model = _model()
    if rank == 3:  # the newcomer builds its optimizer before joining: no collective
        opt = _zero(model, 2)
        ident, full, model_sd = id(opt), None, None
    else:
        _new_group(folder, "g3", rank, 3)
        opt = _zero(model, 2)
        ident = id(opt)
        _train(model, opt, range(3))
        full = _full_state(opt)
        model_sd = {k: v.clone() for k, v in model.state_dict().items()}
        dist.destroy_process_group()
    model_sd, full = _join_four(folder, rank, model_sd, full)
    model.load_state_dict(model_sd)
    opt.regroup(full_state=full)
    out = _after_regroup(model, opt, 2, full, model_sd)
    out["same_object"], out["world"] = id(opt) == ident, opt.world
    return out


def test_zero_regroup_grows_from_three_to_four_ranks() -> None:
    folder = tempfile.mkdtemp(prefix="phalanx-zero-grow-")
    results = run_distributed(_grow, folder, world_size=4, timeout=90, env=NO_CHECK)
    for out in results:
        assert out["same_object"] and out["world"] == 4
        assert out["grad_err"] < 1e-6, out["grad_err"]
        assert out["hooks"] == [1] * 4
        assert out["moved"] and out["params"] and out["state"], out


def _bad_input() -> list[str]:
    model = _model()
    opt = _zero(model, 2)
    _train(model, opt, range(1))
    other = nn.Linear(5, 7)
    plain = torch.optim.Adam(other.parameters())
    other(torch.ones(1, 5)).sum().backward()
    plain.step()
    before = [p.detach().clone() for p in model.parameters()]
    errors = []
    bads: list[Any] = [plain.state_dict(), {"state": {}}, "state"]
    for bad in bads:
        try:
            opt.regroup(full_state=bad)
        except (TypeError, ValueError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    _train(model, opt, range(1, 2))  # untouched: still trains over the old layout
    assert opt.world == 2 and not _same(before, [p.detach() for p in model.parameters()])
    assert opt.state_bytes() > 0
    opt.param_groups[0]["lr"] = 0.5
    opt.regroup()  # the same group, no state: the state starts empty, the options stay
    assert opt.state_bytes() == 0 and opt.optim.param_groups[0]["lr"] == 0.5
    return errors


def test_zero_regroup_refuses_the_state_of_another_model() -> None:
    for errors in run_distributed(_bad_input, world_size=2, timeout=60):
        assert len(errors) == 3, errors
        assert errors[0].startswith("ValueError") and "full_state is of another model" in errors[0]
        assert "[2]" in errors[0] and "[4]" in errors[0], errors[0]
        assert errors[1].startswith("TypeError") and "full_state" in errors[1]
        assert errors[2].startswith("TypeError") and "got str" in errors[2]


# ---- ZeRO-3 ------------------------------------------------------------------------------------
def _fsdp(model: nn.Module) -> tuple[FullyShardedDataParallel, torch.optim.Optimizer]:
    fsdp = FullyShardedDataParallel(model, wrap=nn.Linear)
    return fsdp, torch.optim.Adam(fsdp.parameters(), lr=0.01)


def _fsdp_grad_err(fsdp: FullyShardedDataParallel, sd: dict, step: int) -> float:
    """Backward once; the largest error of this rank's gradient shards against the average of
    every rank's gradient, computed on a plain copy of the model."""
    plain = _model()
    plain.load_state_dict(sd)
    named = dict(plain.named_parameters())
    world = dist.get_world_size()
    grads = [torch.autograd.grad(_loss(plain, step, r), list(named.values())) for r in range(world)]
    expected = {k: torch.stack([g[i] for g in grads]).sum(0) / world for i, k in enumerate(named)}
    _loss(fsdp, step, dist.get_rank()).backward()
    err = 0.0
    for unit in fsdp.units:
        grad = unit.flat_param.grad
        assert grad is not None and grad.numel() == unit.chunk
        for piece in unit.pieces:
            diff = piece.held_in(grad) - piece.of_full(expected[piece.key])
            err = max(err, diff.abs().max().item())
    return err


def _fsdp_after_regroup(
    fsdp: FullyShardedDataParallel, opt: torch.optim.Optimizer, model_sd: dict, optim_sd: dict
) -> dict[str, Any]:
    opt.zero_grad(set_to_none=True)
    err = _fsdp_grad_err(fsdp, fsdp.state_dict(), 3)
    opt.step()
    _train(fsdp, opt, range(4, 5))
    params, state = fsdp.state_dict(), fsdp.full_optim_state_dict(opt)
    ref_model = _model()
    ref_model.load_state_dict(model_sd)
    ref, ref_opt = _fsdp(ref_model)
    ref.load_full_optim_state_dict(ref_opt, optim_sd)
    _train(ref, ref_opt, range(3, 5))
    return {
        "grad_err": err,
        "params": _same(params, ref.state_dict()),
        "state": _same(state, ref.full_optim_state_dict(ref_opt)),
        "moved": not _same(params, model_sd),
        "shards": [u.flat_param.numel() for u in fsdp.units],
        "hooks": [
            len(u.module._forward_pre_hooks) + len(u.module._forward_hooks) for u in fsdp.units
        ],
    }


def _fsdp_shrink(folder: str) -> dict[str, Any] | None:
    rank = dist.get_rank()
    fsdp, opt = _fsdp(_model())
    idents = [id(fsdp), id(opt), *map(id, fsdp.parameters())]
    _train(fsdp, opt, range(3))
    model_sd, optim_sd = fsdp.state_dict(), fsdp.full_optim_state_dict(opt)
    dist.destroy_process_group()
    if rank == 3:
        return None
    _new_group(folder, "g3", rank, 3)
    fsdp.regroup(full_state=model_sd, optimizer=opt, optim_state=optim_sd)
    out = _fsdp_after_regroup(fsdp, opt, model_sd, optim_sd)
    out["same_objects"] = [id(fsdp), id(opt), *map(id, fsdp.parameters())] == idents
    out["in_optimizer"] = [p is q for p, q in zip(opt.param_groups[0]["params"], fsdp.parameters())]
    return out


def test_fsdp_regroup_after_a_lost_rank_matches_a_fresh_fsdp() -> None:
    folder = tempfile.mkdtemp(prefix="phalanx-zero3-regroup-")
    results = run_distributed(_fsdp_shrink, folder, world_size=4, timeout=90, may_die=(3,))
    assert results[3] is None
    for out in results[:3]:
        assert out is not None
        assert out["same_objects"] and out["in_optimizer"] == [True, True], out
        assert out["shards"] == [14, 8], out  # 42 and 24 elements over 3 ranks (4: 11 and 6)
        assert out["hooks"] == [2, 2], out  # the old runtime's hooks are gone
        assert out["grad_err"] < 1e-6, out["grad_err"]
        assert out["moved"] and out["params"] and out["state"], out


def _fsdp_grow(folder: str) -> dict[str, Any]:
    rank = dist.get_rank()
    dist.barrier()  # every rank's connections are up before one tears its group down
    dist.destroy_process_group()
    if rank == 3:  # the newcomer wraps its model in a world of its own, then joins
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        fsdp, opt = _fsdp(_model())
        model_sd, optim_sd = None, None
    else:
        _new_group(folder, "g3", rank, 3)
        fsdp, opt = _fsdp(_model())
        _train(fsdp, opt, range(3))
        model_sd, optim_sd = fsdp.state_dict(), fsdp.full_optim_state_dict(opt)
    idents = [id(fsdp), id(opt), *map(id, fsdp.parameters())]
    dist.destroy_process_group()
    model_sd, optim_sd = _join_four(folder, rank, model_sd, optim_sd)
    fsdp.regroup(full_state=model_sd, optimizer=opt, optim_state=optim_sd)
    out = _fsdp_after_regroup(fsdp, opt, model_sd, optim_sd)
    out["same_objects"] = [id(fsdp), id(opt), *map(id, fsdp.parameters())] == idents
    return out


def test_fsdp_regroup_grows_from_three_to_four_ranks() -> None:
    folder = tempfile.mkdtemp(prefix="phalanx-zero3-grow-")
    for out in run_distributed(_fsdp_grow, folder, world_size=4, timeout=90, env=NO_CHECK):
        assert out["same_objects"] and out["shards"] == [11, 6] and out["hooks"] == [2, 2], out
        assert out["grad_err"] < 1e-6, out["grad_err"]
        assert out["moved"] and out["params"] and out["state"], out


def _fsdp_bad_input() -> list[str]:
    fsdp, opt = _fsdp(_model())
    _train(fsdp, opt, range(1))
    model_sd, optim_sd = fsdp.state_dict(), fsdp.full_optim_state_dict(opt)
    other = nn.Linear(5, 7)
    plain = torch.optim.Adam(other.parameters())
    other(torch.ones(1, 5)).sum().backward()
    plain.step()
    wrong_shape = {**model_sd, "2.weight": torch.zeros(4, 7)}
    calls: list[dict[str, Any]] = [
        {"full_state": other.state_dict()},
        {"full_state": wrong_shape},
        {"full_state": None},
        {"full_state": model_sd, "optimizer": opt, "optim_state": plain.state_dict()},
    ]
    errors = []
    for kwargs in calls:
        try:
            fsdp.regroup(**kwargs)
        except (TypeError, ValueError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    _train(fsdp, opt, range(1, 2))  # untouched: still trains over the old shards
    assert not _same(fsdp.state_dict(), model_sd) and optim_sd["state"]
    assert all(u.flat_param in opt.state for u in fsdp.units)
    fsdp.regroup(full_state=model_sd, optimizer=opt)  # no optim_state: the state starts empty
    assert not opt.state and _same(fsdp.state_dict(), model_sd)
    return errors


def test_fsdp_regroup_refuses_the_state_of_another_model() -> None:
    for errors in run_distributed(_fsdp_bad_input, world_size=2, timeout=60):
        assert len(errors) == 4, errors
        assert "full_state is of another model" in errors[0] and "2.weight" in errors[0]
        assert "'2.weight' has shape (4, 7)" in errors[1], errors[1]
        assert "full_state is required" in errors[2], errors[2]
        assert "optim_state is of another model" in errors[3], errors[3]
