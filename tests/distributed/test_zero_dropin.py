"""phalanx.ZeroRedundancyOptimizer as a drop-in for torch's, on 2 gloo ranks.

Under DDP it gives torch's class's parameters and consolidated state step for step (tolerance
1e-6 relative: both run the same element-wise optimizer arithmetic, on whole parameters in
torch's class and on ranges of them in phalanx's). Also: consolidation to a chosen rank,
``Join`` with uneven inputs, parameters without gradients on some or all ranks, and parameter
groups added after construction being sharded over the ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as DDP

import phalanx
from phalanx.sharding import ZeroRedundancyOptimizer
from phalanx.testing import run_distributed


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 3), nn.Linear(3, 2), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, use_a: bool = True, use_c: bool = False) -> torch.Tensor:
        h = torch.tanh(self.a(x)) if use_a else torch.tanh(x[:, :3])
        y = self.b(h)
        return y + self.c(y) if use_c else y


def _x(step: int, rank: int) -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(100 * step + rank))


OPTS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adam": (torch.optim.Adam, {"lr": 0.05}),
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
}


def _params(m: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in m.parameters()]


# ---- the same as torch's class, under DDP --------------------------------------------------------
def _against_torch(name: str, view: bool) -> dict[str, Any]:
    cls, kw = OPTS[name]
    rank = phalanx.world().rank
    theirs_model, ours_model = _Net(), _Net()
    ddp_t = DDP(theirs_model, find_unused_parameters=True)
    ddp_o = DDP(ours_model, find_unused_parameters=True)
    theirs = TorchZero(ddp_t.parameters(), cls, parameters_as_bucket_view=view, **kw)
    ours = ZeroRedundancyOptimizer(ddp_o.parameters(), cls, parameters_as_bucket_view=view, **kw)
    diffs = []
    for step in range(6):
        if step in (2, 4):  # freeze, then unfreeze, the first layer's weight (as torch's test)
            for m in (theirs_model, ours_model):
                m.a.weight.requires_grad_(step == 4)
        x = _x(step, rank)
        for ddp, opt in ((ddp_t, theirs), (ddp_o, ours)):

            def closure(ddp: Any = ddp, opt: Any = opt, x: torch.Tensor = x) -> torch.Tensor:
                opt.zero_grad()
                loss = ddp(x).square().sum()
                loss.backward()
                return loss

            opt.step(closure)
        diffs.append(
            max(
                (a - b).abs().max().item()
                for a, b in zip(theirs_model.parameters(), ours_model.parameters())
            )
        )
    theirs.consolidate_state_dict(to=0)
    ours.consolidate_state_dict(to=0)
    states = (theirs.state_dict(), ours.state_dict()) if rank == 0 else None
    return {"diffs": diffs, "states": states, "params": _params(ours_model)}


@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_equals_torchs_class_under_ddp(name: str, view: bool) -> None:
    results = run_distributed(_against_torch, name, view, world_size=2)
    for res in results:
        assert max(res["diffs"]) <= 1e-6, res["diffs"]
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)  # replicas bit-identical
    theirs, ours = results[0]["states"]
    assert ours["param_groups"] == theirs["param_groups"]
    assert sorted(ours["state"]) == sorted(theirs["state"])  # `c` is never used: absent
    for i, st in theirs["state"].items():
        assert sorted(ours["state"][i]) == sorted(st)
        for k, v in st.items():
            torch.testing.assert_close(ours["state"][i][k], v, rtol=1e-6, atol=1e-7)


# ---- consolidate to any rank -----------------------------------------------------------------
def _consolidate_to_last() -> dict[str, Any]:
    world = phalanx.world()
    model = _Net()
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.05)
    opt.zero_grad()
    model(_x(0, 0)).square().sum().backward()  # same data everywhere: no averaging needed
    opt.step()
    opt.consolidate_state_dict(to=world.world_size - 1)
    try:
        return {"state": opt.state_dict(), "error": None}
    except RuntimeError as exc:
        return {"state": None, "error": str(exc)}


def test_consolidate_state_dict_gathers_on_the_rank_named_by_to() -> None:
    first, last = run_distributed(_consolidate_to_last, world_size=2)
    assert first["state"] is None
    assert "not been consolidated on rank 0; call consolidate_state_dict(to=0)" in first["error"]
    model = _Net()
    plain = torch.optim.Adam(model.parameters(), lr=0.05)
    model(_x(0, 0)).square().sum().backward()
    plain.step()
    want = plain.state_dict()
    assert sorted(last["state"]["state"]) == sorted(want["state"]) == [0, 1, 2, 3]
    for i, st in want["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(last["state"]["state"][i][k], v)


# ---- Join: uneven inputs -----------------------------------------------------------------------
def _join(stage: int | None) -> dict[str, Any]:
    rank = phalanx.world().rank
    model = _Net()
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, stage=stage, lr=0.05)
    assert isinstance(opt, Joinable) and opt.join_device == torch.device("cpu")
    assert opt.join_process_group == dist.group.WORLD
    with Join([opt]):
        for step in range(2 + rank):  # rank 1 has one batch more
            opt.zero_grad()
            model(_x(step, rank)).square().sum().backward()
            opt.step()
    return {"params": _params(model)}


def _join_reference() -> list[torch.Tensor]:
    """Stages 1/2: a rank that has joined contributes zeros; the sum is divided by 2."""
    model = _Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for step in range(3):
        opt.zero_grad()
        ranks = [0, 1] if step < 2 else [1]
        sum(model(_x(step, r)).square().sum() for r in ranks).backward()  # type: ignore[union-attr]
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= 2
        opt.step()
    return _params(model)


@pytest.mark.parametrize("stage", [None, 1, 2])
def test_join_shadows_the_steps_of_a_rank_that_ran_out_of_inputs(stage: int | None) -> None:
    results = run_distributed(_join, stage, world_size=2, timeout=60)
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)
    if stage is not None:
        for got, want in zip(results[0]["params"], _join_reference()):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ---- parameters without gradients ------------------------------------------------------------
def _missing(stage: int) -> dict[str, Any]:
    rank = phalanx.world().rank
    model = _Net()
    opt = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.Adam, stage=stage, bucket_cap_mb=1e-4, lr=0.05
    )
    for step in range(3):
        opt.zero_grad()
        # Rank 1 skips `a`; `c` is used in step 0 only (then Adam's moments would move it).
        model(_x(step, rank), use_a=rank == 0, use_c=step == 0).square().sum().backward()
        opt.step()
        if step == 0:
            after_first = _params(model)[-2:]
    return {"params": _params(model), "c_after_first_step": after_first}


def _missing_reference() -> list[torch.Tensor]:
    model = _Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for step in range(3):
        opt.zero_grad()
        outs = [model(_x(step, r), use_a=r == 0, use_c=step == 0) for r in (0, 1)]
        sum(o.square().sum() for o in outs).backward()  # type: ignore[union-attr]
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= 2  # `a`: rank 0's gradient averaged with rank 1's zeros
        opt.step()
    return _params(model)


@pytest.mark.parametrize("stage", [1, 2])
def test_gradients_missing_on_a_rank_average_as_zeros_and_missing_everywhere_skip(
    stage: int,
) -> None:
    results = run_distributed(_missing, stage, world_size=2)
    want = _missing_reference()
    for res in results:
        for got, ref in zip(res["params"], want):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        # `c` has a gradient on no rank after step 0: it stays as step 0 left it.
        assert all(torch.equal(a, b) for a, b in zip(res["params"][-2:], res["c_after_first_step"]))


# ---- add_param_group shards the new group ----------------------------------------------------
def _added_group(stage: int | None) -> dict[str, Any]:
    model = _Net()
    weights = [model.a.weight, model.b.weight]
    opt = ZeroRedundancyOptimizer(weights, torch.optim.SGD, stage=stage, lr=0.1, momentum=0.9)
    opt.add_param_group({"params": [model.a.bias, model.b.bias], "lr": 0.01})
    for step in range(3):
        opt.zero_grad()
        model(_x(step, 0)).square().sum().backward()  # same data everywhere
        opt.step()
    sizes = [sum(t.numel() for t in g["params"]) for g in opt.optim.param_groups]
    return {"params": _params(model), "sizes": sizes}


@pytest.mark.parametrize("stage", [None, 2])
def test_an_added_group_is_sharded_over_the_ranks_and_stepped(stage: int | None) -> None:
    results = run_distributed(_added_group, stage, world_size=2)
    model = _Net()
    opt = torch.optim.SGD([model.a.weight, model.b.weight], lr=0.1, momentum=0.9)
    opt.add_param_group({"params": [model.a.bias, model.b.bias], "lr": 0.01})
    for step in range(3):
        opt.zero_grad()
        model(_x(step, 0)).square().sum().backward()
        opt.step()
    for res in results:
        for got, want in zip(res["params"], _params(model)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # 18 weights + 5 biases = 23 elements: 12 and 11, the new group split between the ranks.
    totals = sorted(sum(r["sizes"]) for r in results)
    assert totals == [11, 12]
    assert all(r["sizes"][1] > 0 for r in results)
