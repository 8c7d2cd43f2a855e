"""Layer split across devices in one process (seed 001 §4): balance, validation, parity.

Parity tolerance: on ``["cpu", "cpu"]`` the split model runs exactly the same kernels on the same
tensors in the same order as the unsplit one (``Tensor.to`` to the same device is the identity),
so outputs, losses, gradients and optimizer steps must be bit-exact: ``rtol=0, atol=0``.
"""

from __future__ import annotations

import copy
import itertools
import random
from typing import Any

import pytest
import torch
from torch import nn

from phalanx.data_parallel.buckets import ParamSpec, plan_buckets
from phalanx.model_parallel import SplitModule, split_across_devices
from phalanx.model_parallel._balance import balance_by_cost
from phalanx.models import small_resnet

CPU = torch.device("cpu")
META = torch.device("meta")  # parameters really move there; shapes propagate, nothing computes


def resnet_like() -> nn.Sequential:
    """Seed 001's layer chain, tiny (width 8)."""
    return small_resnet(width=8)


# ---- balance_by_cost (pure) -----------------------------------------------------------------
def _brute_max(costs: list[int], parts: int) -> int:
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), parts - 1):
        bounds = (0, *cuts, len(costs))
        worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
        best = worst if best is None else min(best, worst)
    assert best is not None
    return best


def test_balance_by_cost_minimises_the_largest_part_against_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 8)
        parts = rng.randint(1, n)
        costs = [rng.choice([0, 0, 1, 2, 5, 10, 100]) for _ in range(n)]
        counts = balance_by_cost(costs, parts)
        assert len(counts) == parts and min(counts) >= 1 and sum(counts) == n
        bounds = list(itertools.accumulate([0, *counts]))
        worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
        assert worst == _brute_max(costs, parts), (costs, parts, counts)


def test_balance_by_cost_breaks_ties_sensibly() -> None:
    assert balance_by_cost([100, 0, 0, 100], 2) == [3, 1]  # free layers stay with the conv
    assert balance_by_cost([100, 100, 0], 2) == [1, 2]  # no part left with nothing to hold
    assert balance_by_cost([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert balance_by_cost([0, 0, 0, 0, 0], 2) == [3, 2]  # no parameters: even by count
    assert balance_by_cost([7], 1) == [1]


@pytest.mark.parametrize(
    ("costs", "parts", "words"),
    [
        ([1, 2], 0, ["parts", "0"]),
        ([1, 2], 3, ["2 layer", "parts=3"]),
        ([1, -4, 2], 2, ["costs", "-4"]),
    ],
)
def test_balance_by_cost_rejects_bad_arguments(
    costs: list[int], parts: int, words: list[str]
) -> None:
    with pytest.raises(ValueError) as info:
        balance_by_cost(costs, parts)
    for word in words:
        assert word in str(info.value)


# ---- validation -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"balance": [4, 4]}, ValueError, ["balance=[4, 4]", "sums to 8", "9 layers"]),
        ({"balance": [9]}, ValueError, ["balance=[9]", "1 entries", "2 devices"]),
        ({"balance": [0, 9]}, ValueError, ["balance=[0, 9]", "at least 1 layer"]),
        ({"balance": [4.5, 4.5]}, TypeError, ["[4.5, 4.5]"]),
        ({"devices": ["cpu"] * 10}, ValueError, ["10 devices", "only 9 layer"]),
        ({"devices": "cpu"}, TypeError, ["'cpu'"]),
        ({"devices": []}, ValueError, ["[]"]),
        ({"devices": ["cpu", "not-a-device"]}, ValueError, ["not-a-device"]),
    ],
)
def test_split_rejects_bad_arguments_naming_the_values(
    kwargs: dict[str, Any], error: type[Exception], words: list[str]
) -> None:
    args: dict[str, Any] = {"devices": ["cpu", "cpu"], **kwargs}
    with pytest.raises(error) as info:
        split_across_devices(resnet_like(), **args)
    for word in words:
        assert word in str(info.value)


def test_split_rejects_models_that_are_not_chains_and_shared_parameters() -> None:
    with pytest.raises(TypeError, match=r"nn\.Sequential or a list of modules, got Linear"):
        split_across_devices(nn.Linear(2, 2), ["cpu"])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"layer 1 must be an nn\.Module, got int"):
        split_across_devices([nn.ReLU(), 3], ["cpu"])  # type: ignore[list-item]
    tied = nn.Linear(4, 4)
    with pytest.raises(
        ValueError, match=r"'2.weight' of part 1 \(meta\) is also '0.weight' of part 0 \(cpu\)"
    ):
        split_across_devices([tied, nn.ReLU(), tied], ["cpu", "meta"], balance=[1, 2])
    same_device = split_across_devices([tied, nn.ReLU(), tied], ["cpu", "cpu"], balance=[1, 2])
    assert same_device(torch.ones(1, 4)).shape == (1, 4)  # tied layers on one device are fine


# ---- placement and structure --------------------------------------------------------------------
def test_parts_live_on_their_devices_and_inputs_follow() -> None:
    model = split_across_devices(resnet_like(), [CPU, "meta"], balance=[4, 5])
    assert model.devices == (CPU, META) and model.output_device == META
    assert model.balance == (4, 5) and model.ranges() == [(0, 4), (4, 9)]
    assert list(model.parts[0]._modules) == ["conv1", "bn1", "relu", "layer1"]
    for part, device in zip(model.parts, model.devices):
        assert {p.device for p in part.parameters()} == {device}
        assert {b.device for b in part.buffers()} == {device}
    out = model(torch.randn(2, 1, 8, 8))  # part 0 computes on CPU; its output moves to meta
    assert out.device == META and out.shape == (2, 10)
    text = model.describe()
    assert "part 0 on cpu: layers 0-3 [conv1 .. layer1]" in text
    assert "part 1 on meta: layers 4-8 [layer2 .. fc]" in text
    assert "balance=[4, 5]" in repr(model)


def test_default_balance_is_by_parameter_count() -> None:
    layers = resnet_like()
    costs = [sum(p.numel() for p in m.parameters()) for m in layers]
    model = split_across_devices(layers, ["cpu", "cpu", "cpu"])
    assert list(model.balance) == balance_by_cost(costs, 3)
    per_part = [sum(p.numel() for p in part.parameters()) for part in model.parts]
    assert max(per_part) == _brute_max(costs, 3)


class _Record(nn.Module):
    """Records the devices of a structured input; passes the first tensor on."""

    def forward(self, x: Any) -> torch.Tensor:
        self.seen = [t.device for t in x["pair"]] + [x["one"].device]
        return x["pair"][0]


def test_structured_inputs_move_to_the_part_device() -> None:
    record = _Record()
    model = SplitModule([nn.Sequential(nn.Identity()), nn.Sequential(record)], [CPU, META])
    out = model({"pair": (torch.ones(2), torch.ones(3)), "one": torch.ones(1)})
    assert record.seen == [META, META, META] and out.device == META


def test_gradient_buckets_of_a_split_model_never_mix_devices() -> None:
    # What DistributedDataParallel plans for a split model: one device per bucket.
    model = split_across_devices(resnet_like(), [CPU, "meta"], balance=[5, 4])
    params = list(model.parameters())
    specs = [
        ParamSpec(i, p.numel(), p.element_size(), str(p.dtype), str(p.device))
        for i, p in enumerate(params)
    ]
    plans = plan_buckets(specs, [1024, 4096])
    assert {plan.device for plan in plans} == {"cpu", "meta"}
    for plan in plans:
        assert {str(params[j].device) for j in plan.params} == {plan.device}
    assert sorted(j for plan in plans for j in plan.params) == list(range(len(params)))


# ---- parity with the unsplit model ---------------------------------------------------------------
def _train(model: nn.Module, steps: int) -> list[dict[str, torch.Tensor]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    records = []
    for _ in range(steps):
        x, y = torch.randn(6, 1, 8, 8, generator=g), torch.randint(0, 10, (6,), generator=g)
        opt.zero_grad()
        out = model(x)
        loss = nn.functional.cross_entropy(out, y.to(out.device))
        loss.backward()
        named = dict(model.named_parameters())
        record = {"out": out.detach().clone(), "loss": loss.detach().clone()}
        record.update({f"grad:{i}": p.grad.clone() for i, p in enumerate(named.values())})  # type: ignore[union-attr]
        opt.step()
        record.update({f"param:{i}": p.detach().clone() for i, p in enumerate(named.values())})
        records.append(record)
    return records


def test_split_model_matches_the_unsplit_model_bit_for_bit() -> None:
    torch.manual_seed(0)
    whole = resnet_like()
    split = split_across_devices(copy.deepcopy(whole), [CPU, CPU])
    assert split.balance[0] >= 2 and split.balance[1] >= 2  # a real cut through the chain
    for step, (want, got) in enumerate(zip(_train(whole, 3), _train(split, 3))):
        assert want.keys() == got.keys()
        for key in want:
            torch.testing.assert_close(
                got[key], want[key], rtol=0, atol=0, msg=f"step {step}: {key} differs"
            )
    for a, b in zip(whole.buffers(), split.buffers()):  # BatchNorm running statistics
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_split_over_two_gpus_matches_one_gpu() -> None:
    torch.manual_seed(0)
    whole = resnet_like().to("cuda:0")
    split = split_across_devices(copy.deepcopy(whole), ["cuda:0", "cuda:1"])
    assert {p.device for p in split.parts[1].parameters()} == {torch.device("cuda:1")}
    want, got = _train(whole, 2), _train(split, 2)
    for w, g in zip(want, got):
        for key in w:
            # Same kernels, but cuDNN may pick different algorithms per device: float32 defaults.
            torch.testing.assert_close(g[key].to("cuda:0"), w[key], msg=key)
