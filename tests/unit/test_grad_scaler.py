"""``AgreedGradScaler`` in one process: a route sends the unscale and the inf check to where the
gradients are (ZeRO-2's shape: the stepped optimizer's parameters have none), and the step of
the optimizer the route belongs to is skipped on an inf found there."""

from __future__ import annotations

import torch

from phalanx.train.grad_scaler import AgreedGradScaler, GradShards


class _Outer(torch.optim.SGD):
    """Stands for a sharded optimizer: its step() counts, its parameters hold no gradient."""

    steps = 0

    def step(self, closure: object = None) -> None:  # type: ignore[override]
        type(self).steps += 1


def _setup(value: float) -> tuple[AgreedGradScaler, _Outer, GradShards, list[int], torch.Tensor]:
    scaler = AgreedGradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))  # creates the scale, as the first backward does
    outer = _Outer([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    shard = torch.nn.Parameter(torch.zeros(2))
    holder = torch.optim.SGD([shard], lr=0.1)
    readied: list[int] = []
    shards = GradShards(holder, ready=lambda: readied.append(1))
    shard.grad = torch.tensor([8.0, value])
    return scaler, outer, shards, readied, shard


def test_a_route_unscales_the_holders_gradients_and_steps_the_optimizer() -> None:
    scaler, outer, shards, readied, shard = _setup(4.0)
    _Outer.steps = 0
    scaler.route(outer, shards)
    scaler.unscale_(outer)  # what clip does; step() must not unscale again
    assert shard.grad is not None and shard.grad.tolist() == [2.0, 1.0]
    scaler.step(outer)
    scaler.update()
    assert shard.grad.tolist() == [2.0, 1.0] and readied == [1] and _Outer.steps == 1
    assert scaler.get_scale() == 4.0


def test_an_inf_in_the_holder_skips_the_optimizers_step_and_backs_off() -> None:
    scaler, outer, shards, _, _ = _setup(float("inf"))
    _Outer.steps = 0
    scaler.route(outer, shards)
    scaler.step(outer)
    scaler.update()
    assert _Outer.steps == 0 and scaler.get_scale() == 2.0


def test_without_a_route_it_is_torchs_scaler() -> None:
    scaler, outer, shards, _, _ = _setup(float("inf"))
    _Outer.steps = 0
    scaler.route(outer, shards)
    scaler.route(outer, None)  # dropped: the outer parameters' (absent) gradients again
    p = outer.param_groups[0]["params"][0]
    p.grad = torch.full((3,), 4.0)
    scaler.step(outer)
    scaler.update()
    assert _Outer.steps == 1 and p.grad.tolist() == [1.0, 1.0, 1.0]


def test_a_rank_holding_no_gradient_still_steps() -> None:
    # A ZeRO rank whose ranges got no gradient: torch's scaler would assert "No inf checks
    # were recorded"; the routed one records a clear flag (and, agreeing, joins the all-reduce).
    scaler, outer, shards, _, shard = _setup(1.0)
    shard.grad = None
    _Outer.steps = 0
    scaler.route(outer, shards)
    scaler.step(outer)
    scaler.update()
    assert _Outer.steps == 1
