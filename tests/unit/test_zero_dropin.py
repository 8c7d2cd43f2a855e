"""phalanx.ZeroRedundancyOptimizer behaves as torch's, in one process (world size 1).

Each test compares against a plain ``torch.optim`` optimizer (or torch's own behaviour) on the
point where phalanx's class used to differ: parameters without gradients, parameter groups
added later, parameters frozen at construction, ``step(closure, **kwargs)``, the constructor's
signature and argument errors, ``consolidate_state_dict`` / ``state_dict`` / ``load_state_dict``.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, ClassVar

import pytest
import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

from phalanx.sharding import ZeroRedundancyOptimizer

MODES = [(None, False), (None, True), (1, False), (1, True), (2, False), (2, True)]
"""(stage, parameters_as_bucket_view)"""


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _x(step: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(step))


def _zero(params: Any, cls: type, stage: int | None, view: bool, **kw: Any) -> Any:
    return ZeroRedundancyOptimizer(params, cls, parameters_as_bucket_view=view, stage=stage, **kw)


def _same(a: nn.Module, b: nn.Module) -> None:
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("stage", "view"), MODES)
def test_a_parameter_without_grad_is_not_stepped(stage: int | None, view: bool) -> None:
    model, twin = _model(), _model()
    zero = _zero(model.parameters(), torch.optim.Adam, stage, view, lr=0.1)
    plain = torch.optim.Adam(twin.parameters(), lr=0.1)
    for step in range(4):
        for m, opt in ((model, zero), (twin, plain)):
            opt.zero_grad()
            # From step 2 on the first layer is not used: its parameters get no gradient, and
            # torch.optim leaves them (and their state) alone.
            h = torch.tanh(_x(step)[:, :3]) if step >= 2 else m[1](m[0](_x(step)))
            m[2](h).square().sum().backward()
            opt.step()
        if step == 1:
            frozen = model[0].weight.detach().clone()
    _same(model, twin)
    assert torch.equal(model[0].weight, frozen)  # Adam with a zero gradient would move it


@pytest.mark.parametrize(("stage", "view"), MODES)
def test_a_parameter_frozen_at_construction_is_stepped_once_unfrozen(
    stage: int | None, view: bool
) -> None:
    model, twin = _model(), _model()
    for m in (model, twin):
        m[0].weight.requires_grad_(False)
    zero = _zero(model.parameters(), torch.optim.AdamW, stage, view, lr=0.1)
    plain = torch.optim.AdamW(twin.parameters(), lr=0.1)
    start = model[0].weight.detach().clone()
    for step in range(4):
        if step == 2:
            for m in (model, twin):
                m[0].weight.requires_grad_(True)
        for m, opt in ((model, zero), (twin, plain)):
            opt.zero_grad()
            m(_x(step)).square().sum().backward()
            opt.step()
    _same(model, twin)
    assert not torch.equal(model[0].weight, start)


@pytest.mark.parametrize(("stage", "view"), MODES)
def test_an_added_parameter_group_is_stepped_with_its_options(
    stage: int | None, view: bool
) -> None:
    model, twin = _model(), _model()
    weights = [model[0].weight, model[2].weight]
    biases = [model[0].bias, model[2].bias]
    zero = _zero(weights, torch.optim.AdamW, stage, view, lr=0.1)
    zero.add_param_group({"params": biases, "lr": 0.01, "weight_decay": 0.5})
    plain = torch.optim.AdamW([twin[0].weight, twin[2].weight], lr=0.1)
    plain.add_param_group({"params": [twin[0].bias, twin[2].bias], "lr": 0.01, "weight_decay": 0.5})
    for step in range(3):
        for m, opt in ((model, zero), (twin, plain)):
            opt.zero_grad()
            m(_x(step)).square().sum().backward()
            opt.step()
    _same(model, twin)
    assert len(zero.param_groups) == len(zero.optim.param_groups) == 2
    assert zero.param_groups[1]["params"] == biases  # the user's tensors, as torch's exposes
    assert zero.param_groups[1]["lr"] == zero.optim.param_groups[1]["lr"] == 0.01


class _SGDWithKwargs(torch.optim.SGD):
    seen: ClassVar[list[Any]] = []

    def step(self, closure: Any = None, scale: float = 1.0) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        for g in self.param_groups:
            g["lr"] *= scale
        super().step()
        self.seen.append(scale)
        return loss


@pytest.mark.parametrize(("stage", "view"), MODES)
def test_step_passes_closure_and_kwargs_to_the_inner_step(stage: int | None, view: bool) -> None:
    model, twin = _model(), _model()
    zero = _zero(model.parameters(), _SGDWithKwargs, stage, view, lr=0.1)
    plain = _SGDWithKwargs(twin.parameters(), lr=0.1)
    losses = []
    for m, opt in ((model, zero), (twin, plain)):

        def closure(m: nn.Module = m, opt: Any = opt) -> torch.Tensor:
            opt.zero_grad()
            loss = m(_x(0)).square().sum()
            loss.backward()
            return loss

        losses.append(opt.step(closure, scale=0.5))
    torch.testing.assert_close(losses[0], losses[1])
    assert _SGDWithKwargs.seen[-2:] == [0.5, 0.5]
    assert zero.param_groups[0]["lr"] == pytest.approx(0.05)  # the inner change is exposed
    _same(model, twin)


def test_constructor_signature_is_torchs_plus_keyword_only_extras() -> None:
    ours = inspect.signature(ZeroRedundancyOptimizer).parameters
    theirs = inspect.signature(TorchZero).parameters
    positional = [n for n, p in ours.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == [n for n, p in theirs.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert all(ours[n].default == theirs[n].default for n in positional)
    assert ours["stage"].kind == ours["bucket_cap_mb"].kind == inspect.Parameter.KEYWORD_ONLY
    assert ours["stage"].default is None


@pytest.mark.parametrize("view", [False, True])
def test_parameters_as_bucket_view_has_torchs_meaning(view: bool) -> None:
    model = _model()
    before = [p.data_ptr() for p in model.parameters()]
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, None, view, lr=0.1)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    if view:  # one bucket: the parameters are views of one buffer
        assert len(storages) == 1
    else:  # each parameter keeps its own storage
        assert [p.data_ptr() for p in model.parameters()] == before
    assert "parameters_as_bucket_view" not in zero.optim.defaults  # not an optimizer option
    assert "overlap_with_ddp" not in zero.optim.defaults


def test_overlap_with_ddp_is_refused_naming_the_alternative() -> None:
    with pytest.raises(ValueError, match=r"overlap_with_ddp=True .* stage=2"):
        ZeroRedundancyOptimizer(_model().parameters(), torch.optim.SGD, overlap_with_ddp=True)


def _bad_params(kind: str) -> Any:
    p = nn.Parameter(torch.zeros(2))
    return {
        "tensor": torch.zeros(2),
        "float": 1.2,
        "int in list": [p, 42],
        "int in group": [{"params": [p, "w"]}],
        "empty": [],
        "no params key": [{"lr": 0.1}],
        "sparse": [torch.sparse_coo_tensor(size=(2, 3))],
        "dtypes": [p, nn.Parameter(torch.zeros(2, dtype=torch.float64))],
    }[kind]


@pytest.mark.parametrize(
    ("kind", "error", "words"),
    [
        ("tensor", TypeError, r"params must be an iterable .* got a single torch\.FloatTensor"),
        ("float", TypeError, r"params must be an iterable .* got float 1\.2"),
        ("int in list", TypeError, r"params\[1\] must be a Tensor, got int 42"),
        ("int in group", TypeError, r"params\[0\]\['params'\]\[1\] must be a Tensor, got str 'w'"),
        ("empty", ValueError, r"params is empty"),
        ("no params key", ValueError, r"params\[0\] is a parameter group without a 'params' key"),
        ("sparse", ValueError, r"params\[0\] is a torch\.sparse_coo tensor"),
        (
            "dtypes",
            ValueError,
            r"params\[0\] is torch\.float32 on cpu, params\[1\] is torch\.float64",
        ),
    ],
)
def test_invalid_params_raise_torchs_exception_type_naming_the_value(
    kind: str, error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        ZeroRedundancyOptimizer(_bad_params(kind), torch.optim.SGD, lr=0.1)


@pytest.mark.parametrize(("stage", "view"), MODES)
def test_consolidated_state_dict_is_a_plain_optimizers(stage: int | None, view: bool) -> None:
    model, twin = _model(), _model()
    zero = _zero(model.parameters(), torch.optim.Adam, stage, view, lr=0.1)
    plain = torch.optim.Adam(twin.parameters(), lr=0.1)
    for step in range(2):
        for m, opt in ((model, zero), (twin, plain)):
            opt.zero_grad()
            # The first layer is used in step 0 only: its state counts one step, the rest two.
            h = torch.tanh(_x(step)[:, :3]) if step == 1 else m[1](m[0](_x(step)))
            m[2](h).square().sum().backward()
            opt.step()
    with pytest.raises(RuntimeError, match=r"call consolidate_state_dict\(to=0\)"):
        zero.state_dict()
    zero.consolidate_state_dict(to=0)
    mine, want = zero.state_dict(), plain.state_dict()
    assert mine["param_groups"] == want["param_groups"]
    assert sorted(mine["state"]) == sorted(want["state"])
    for i, st in want["state"].items():
        assert sorted(mine["state"][i]) == sorted(st)
        for k, v in st.items():
            torch.testing.assert_close(mine["state"][i][k], v)
    # Cross-load: each takes the other's state and they still step alike.
    again = copy.deepcopy(model)
    fresh = _zero(again.parameters(), torch.optim.Adam, stage, view, lr=0.5)
    fresh.load_state_dict(want)
    assert fresh.param_groups[0]["lr"] == 0.1
    plain.load_state_dict(copy.deepcopy(mine))
    for m, opt in ((again, fresh), (twin, plain)):
        opt.zero_grad()
        m(_x(5)).square().sum().backward()
        opt.step()
    _same(again, twin)


def test_state_is_this_ranks_inner_state_also_after_loading() -> None:
    model = _model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.1)
    model(_x(0)).square().sum().backward()
    zero.step()
    zero.consolidate_state_dict(to=0)
    saved = zero.state_dict()
    zero.load_state_dict(saved)
    assert zero.state is zero.optim.state and len(zero.state) == 4
    assert zero.state[model[0].weight]["step"] == 1  # keyed by the parameter (a whole range)
