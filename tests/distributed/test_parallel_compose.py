"""dp x pp and dp x tp (and pp x tp) on 4 ranks equal one process training the whole model.

Each data-parallel replica trains on its own half of the batch; the reference runs the unsplit
GPT on the replicas' batches concatenated, with a mean loss, so its gradient is
the average of the replicas' gradients. Tolerances: the split model computes the same sums in
another order (micro-batches, shards summed by all-reduce, replicas averaged), so parameters and
gradients agree up to float32 reassociation: rtol 1e-4 / atol 1e-6 on gradients of magnitude
~1e-2, tighter than any real divergence (a wrong shard or a missing reduction is off by O(1)).
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Any

import pytest
import torch

import phalanx
from phalanx.mesh import ParallelConfig, make_groups, parallelize
from phalanx.models import GPT, GPTConfig
from phalanx.tensor_parallel import shard_range, vocab_parallel_cross_entropy
from phalanx.testing import run_distributed

CASES = [  # (pp, tp, schedule, micro_batches)
    (2, 1, "1f1b", 4),
    (1, 2, "1f1b", 1),
    (2, 2, "gpipe", 2),
]
PER_REPLICA = 4


def _loss(logits: torch.Tensor, targets: torch.Tensor, group: Any) -> torch.Tensor:
    return vocab_parallel_cross_entropy(logits, targets, group, vocab_size=65)


def _dense_slice(full: torch.Tensor, local: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """The part of a dense tensor that a tensor-parallel shard of shape ``local`` holds."""
    if full.shape == local.shape:
        return full
    (dim,) = [d for d in range(full.dim()) if full.shape[d] != local.shape[d]]
    start, end = shard_range(full.shape[dim], rank, tp)
    return full.narrow(dim, start, end - start)


def _case(pp: int, tp: int, schedule: str, micro: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(65, 16, 4, 4, 32))
    ref = copy.deepcopy(model)
    world = phalanx.world()
    config = ParallelConfig(pp=pp, tp=tp, micro_batches=micro, schedule=schedule)
    groups = make_groups(config.topology(world.world_size))
    split = parallelize(model, groups, config, partial(_loss, group=groups.tp))
    dp, replica, tp_rank = groups.topology.dp, groups.index("dp"), groups.index("tp")
    g = torch.Generator().manual_seed(1)
    xs = torch.randint(0, 65, (dp * PER_REPLICA, 16), generator=g)
    ys = torch.randint(0, 65, (dp * PER_REPLICA, 16), generator=g)
    mine = slice(replica * PER_REPLICA, (replica + 1) * PER_REPLICA)
    names = {id(p): n for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(split.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses, ref_losses = [], []
    for step in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = split.train_step(xs[mine], ys[mine])
        phalanx.all_reduce(loss, phalanx.ReduceOp.AVG, group=groups.dp)
        ref_loss = ref(xs, ys)[1]
        assert ref_loss is not None
        ref_loss.backward()
        losses.append(float(loss))
        ref_losses.append(float(ref_loss))
        dense = dict(ref.named_parameters())
        for p in split.parameters():
            name = names[id(p)]
            want = _dense_slice(dense[name].grad, p, tp_rank, tp)  # type: ignore[arg-type]
            where = f"step {step} {name}"
            torch.testing.assert_close(
                p.grad, want, rtol=1e-4, atol=1e-6, msg=lambda m, w=where: f"{w}: {m}"
            )
        # The whole model's gradient norm: shards summed over tp and pp, replicas counted once.
        total = split.clip_grad_norm_(1e9)  # a bound this large clips nothing
        torch.testing.assert_close(total, torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))
        opt.step()
        ref_opt.step()
    return {
        "losses": losses,
        "ref": ref_losses,
        "params": sum(p.numel() for p in split.parameters()),
    }


def _all_cases() -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    return [_case(*case) for case in CASES]


@pytest.fixture(scope="module")
def results() -> list[list[dict[str, Any]]]:
    return run_distributed(_all_cases, world_size=4, timeout=120)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"pp{c[0]}-tp{c[1]}" for c in CASES])
def test_split_training_matches_the_whole_model(results: Any, index: int) -> None:
    full = sum(p.numel() for p in GPT(GPTConfig(65, 16, 4, 4, 32)).parameters())
    for rank_results in results:
        got = rank_results[index]
        torch.testing.assert_close(got["losses"], got["ref"], rtol=1e-5, atol=1e-6)
        assert got["params"] < full  # each rank holds only its share
