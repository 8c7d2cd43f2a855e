"""``Job.summary()["comm_share"]`` and the phase clock see communication wait in every strategy.

Rank 1 sleeps ``DELAY`` in the last block's forward of every step (every micro-batch, for the
pipeline), so rank 0 must wait for it in communication: in DDP's backward all-reduce, ZeRO's
reduce-scatter or gather, FSDP's collectives, tensor parallel's forward all-reduce, the
pipeline's receive. Rank 0's measured wait per step must be about that delay; rank 1's small.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import phalanx
from phalanx.models import GPT, GPTConfig
from phalanx.testing import run_distributed

DELAY, STEPS, WARM = 0.03, 8, 2
CASES: list[tuple[str, dict[str, Any], int]] = [  # strategy, options, delays per step
    ("ddp", {}, 1),
    ("zero1", {}, 1),
    ("zero2", {}, 1),
    ("zero3", {}, 1),
    ("torch-ddp", {}, 1),
    ("torch-ddp", {"hook": True}, 1),  # the user's own communication hook, timed the same way
    ("torch-zero1", {}, 1),
    ("torch-fsdp", {}, 1),
    ("tensor", {"tp": 2}, 1),  # phalanx.Mesh(**options)
    ("pipeline", {"pp": 2, "micro_batches": 2}, 2),
]


def _loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out[0].reshape(-1, 65), y.reshape(-1))


def _counting_hook(calls: list[int]) -> Any:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state: Any, bucket: Any) -> Any:
        calls.append(1)
        return allreduce_hook(state, bucket)

    return hook


def _one(strategy: str, options: dict[str, Any]) -> dict[str, float]:
    options = dict(options)
    user_hook = options.pop("hook", False)
    torch.manual_seed(0)
    model = GPT(GPTConfig(65, 16, 2, 4, 32))
    slow = phalanx.world().rank == 1

    def pause(_module: Any, _args: Any) -> None:
        if slow:
            time.sleep(DELAY)

    model.blocks[-1].register_forward_pre_hook(pause)  # on rank 1's stage in the pipeline
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    split = strategy in ("pipeline", "tensor")  # GPT: the default vocabulary-parallel loss
    job = phalanx.Job(phalanx.Mesh(**options) if split else strategy, straggler_check_every=0)
    model, opt = job.setup(model, opt, **({} if split else {"loss_fn": _loss}))
    calls: list[int] = []
    if user_hook:
        model.register_comm_hook(None, _counting_hook(calls))
    x = torch.randint(0, 65, (4, 16), generator=torch.Generator().manual_seed(1))
    for step in range(STEPS):
        if step == WARM:  # set-up and first steps (allocations, DDP's bucket rebuild) aside
            waited, start = sum(job.phases.total_wait), time.perf_counter()
        job.forward_backward(x, x)
        job.step(opt)
    steps = STEPS - WARM
    out = {
        "wait": (sum(job.phases.total_wait) - waited) / steps,
        "step": (time.perf_counter() - start) / steps,
        "share": job.summary()["comm_share"],
        "hook_calls": len(calls),
    }
    job.close()
    return out


def _all() -> list[dict[str, float]]:
    torch.set_num_threads(1)
    return [_one(strategy, options) for strategy, options, _ in CASES]


@pytest.fixture(scope="module")
def results() -> list[list[dict[str, float]]]:
    return run_distributed(_all, world_size=2, timeout=180)


@pytest.mark.parametrize(
    "case", range(len(CASES)), ids=[c[0] + ("+hook" if c[1].get("hook") else "") for c in CASES]
)
def test_the_fast_rank_waits_as_long_as_the_slow_one_sleeps(results: Any, case: int) -> None:
    fast, slow = results[0][case], results[1][case]
    delay = DELAY * CASES[case][2]
    assert 0.7 * delay <= fast["wait"] <= fast["step"], (fast, slow)
    assert slow["wait"] < fast["wait"] - 0.5 * delay, (fast, slow)
    assert 0.3 < fast["share"] < 1.0 and slow["share"] < fast["share"] - 0.2, (fast, slow)
    if "hook" in CASES[case][1]:
        assert fast["hook_calls"] >= STEPS  # the user's hook ran, inside the timing one
