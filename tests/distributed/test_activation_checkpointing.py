"""``Job(activation_checkpointing=...)`` under every strategy that splits or shards a model: the
blocks really recompute in backward (a hook inside a block counts its forwards), and training
ends bit-identical to the same job without it (dropout included: the recomputation restores
the random generators)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import phalanx
from phalanx.models import GPT, GPTConfig
from phalanx.testing import run_distributed
from tests.distributed.gpt_cases import lm_loss

STEPS, BATCH = 3, 2
CASES: list[tuple[str, Any]] = [
    ("ddp", "ddp"),
    ("zero1", "zero1"),
    ("zero2", "zero2"),
    ("zero3", "zero3"),
    ("pp2", phalanx.Mesh(pp=2, micro_batches=2)),
    ("tp2", phalanx.Mesh(tp=2)),
]


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 65, (STEPS * 2 * BATCH, 16), generator=g)
    return torch.utils.data.TensorDataset(x, torch.randint(0, 65, x.shape, generator=g))


def _train(strategy: Any, ac: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(65, 16, 2, 4, 32, dropout=0.1))
    forwards = [0]

    def count(*_: Any) -> None:
        forwards[0] += 1

    model.blocks[0].mlp.register_forward_pre_hook(count)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    job = phalanx.Job(strategy, seed=1, activation_checkpointing=ac)
    mesh = isinstance(strategy, phalanx.Mesh)
    wrapped, opt = job.setup(model, opt, loss_fn=None if mesh else lm_loss)
    losses = []
    for x, y in job.progress(job.loader(_data(), batch_size=BATCH, shuffle=False)):
        losses.append(float(job.forward_backward(x, y)))
        job.step()
    params = {k: v.detach().clone() for k, v in wrapped.state_dict().items()}
    job.close()
    return {"losses": losses, "forwards": forwards[0], "params": params}


def _all() -> dict[str, dict[str, Any]]:
    torch.set_num_threads(1)
    out = {}
    for name, strategy in CASES:
        for ac in (None, "full", "selective"):
            out[f"{name}/{ac}"] = _train(strategy, ac)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict[str, Any]]]:
    return run_distributed(_all, world_size=2, timeout=240)


@pytest.mark.parametrize("name", [name for name, _ in CASES])
@pytest.mark.parametrize("ac", ["full", "selective"])
def test_checkpointed_blocks_recompute_and_train_bit_identically(
    results: list[dict[str, dict[str, Any]]], name: str, ac: str
) -> None:
    for rank, by_case in enumerate(results):
        plain, checkpointed = by_case[f"{name}/None"], by_case[f"{name}/{ac}"]
        if plain["forwards"] == 0:  # a pipeline stage without the first block
            assert checkpointed["forwards"] == 0
            continue
        assert checkpointed["forwards"] == 2 * plain["forwards"], (rank, "no recomputation")
        assert checkpointed["losses"] == plain["losses"], rank
        assert checkpointed["params"].keys() == plain["params"].keys()
        for key, value in plain["params"].items():
            assert torch.equal(checkpointed["params"][key], value), (rank, key)


def _zero3_units_inside_blocks(ac: str | None) -> tuple[list[torch.Tensor], int]:
    from phalanx.sharding.zero3 import FullyShardedDataParallel

    phalanx.reset_comm_stats()
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))]
    model = torch.nn.Sequential(*blocks, *(copy_of(blocks[0]) for _ in range(2)))
    if ac is not None:
        phalanx.checkpoint_activations(model, ac)  # the blocks hold the units: recomputed
    sharded = FullyShardedDataParallel(model, wrap=torch.nn.Linear)
    opt = torch.optim.SGD(sharded.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(phalanx.world().rank)
    for _ in range(2):
        opt.zero_grad()
        sharded(torch.randn(4, 8, generator=g)).square().mean().backward()
        opt.step()
    gathers = phalanx.comm_stats()["all_gather_into_tensor"][0]
    return [p.detach().clone() for p in sharded.parameters()], gathers


def _plain_and_checkpointed(ac: str) -> tuple[Any, Any]:
    return _zero3_units_inside_blocks(None), _zero3_units_inside_blocks(ac)


def copy_of(module: torch.nn.Module) -> torch.nn.Module:
    """A fresh copy of ``module`` with its own parameters."""
    import copy

    twin = copy.deepcopy(module)
    for p in twin.parameters():
        torch.nn.init.normal_(p.data, std=0.1)
    return twin


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_zero3_units_inside_a_checkpointed_block_stay_gathered_for_their_backward(
    ac: str,
) -> None:
    """ZeRO-3 frees a unit after its forward; the recomputation of a block holding units runs
    their forwards again in backward, where each stays gathered until its gradient (freed
    there, it would be gathered once more: 31 all-gathers here instead of 25)."""

    for (plain, gathers), (checkpointed, regathers) in run_distributed(
        _plain_and_checkpointed, ac, world_size=2
    ):
        assert len(plain) == len(checkpointed) > 0
        for a, b in zip(plain, checkpointed, strict=True):
            assert torch.equal(a, b)
        assert regathers == gathers  # the recomputation gathers nothing more
