"""Checkpoint resharding: a ZeRO job saved at one world size resumes at another.

The data of every step is one fixed global batch split evenly across the ranks, so the loss of
step k is the same at any world size; after resuming with a different number of ranks the first
losses must equal those of the run that was never interrupted (rtol 1e-5).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import phalanx
from phalanx.models.gpt import GPT, GPTConfig
from phalanx.testing import run_distributed

GLOBAL_BATCH, SEQ, VOCAB = 12, 16, 40
SAVE_AT, STEPS = 3, 5


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    per = GLOBAL_BATCH // world
    mine = data[rank * per : (rank + 1) * per]
    return mine[:, :-1], mine[:, 1:]


def _job(strategy: str, directory: str) -> list[float]:
    """Train to STEPS (resuming from ``directory`` if it holds a checkpoint); return the losses."""
    world = phalanx.world()
    job = phalanx.Job(strategy=strategy, checkpoint_dir=directory, seed=0)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt = job.setup(model, opt, sched)
    assert opt is not None
    job.resume()
    losses = []
    while job.step_count < STEPS:
        x, y = _batch(job.step_count, world.rank, world.world_size)
        _, loss = model(x, y)
        job.backward(loss)
        avg = loss.detach().clone()
        phalanx.all_reduce(avg, phalanx.ReduceOp.AVG)
        losses.append(float(avg))
        job.step()
        if job.step_count == SAVE_AT:
            job.save()
    job.close()
    return losses


def _losses(strategy: str, directory: Path, world_size: int) -> list[float]:
    results = run_distributed(_job, strategy, str(directory), world_size=world_size, timeout=90)
    assert all(r == results[0] for r in results)  # every rank saw the same global loss
    return list(results[0])


@pytest.mark.parametrize(("strategy", "plain"), [("zero2", "ddp"), ("zero3", "single")])
def test_save_at_4_resume_at_2_and_1_and_save_at_2_resume_at_4(
    strategy: str, plain: str, tmp_path: Path
) -> None:
    # Each run saves only at step SAVE_AT; later runs on the same directory resume from it.
    whole = _losses(strategy, tmp_path / "four", 4)
    assert len(whole) == STEPS and whole[-1] < whole[0]
    saved = tmp_path / "four" / f"step-{SAVE_AT:06d}"
    assert len(list(saved.glob("optimizer-shard-*.json"))) == 4  # one per rank, no gather
    assert not (saved / "optimizer.json").exists()
    for world in (2, 1):
        resumed = _losses(strategy, tmp_path / "four", world)
        assert resumed == pytest.approx(whole[SAVE_AT:], rel=1e-5)
    two = _losses(strategy, tmp_path / "two", 2)
    assert two == pytest.approx(whole, rel=1e-5)
    resumed = _losses(strategy, tmp_path / "two", 4)
    assert resumed == pytest.approx(whole[SAVE_AT:], rel=1e-5)
    # A job without sharding (plain model and optimizer) resumes from the sharded pieces too.
    world = 2 if plain == "ddp" else 1
    resumed = _losses(plain, tmp_path / "two", world)
    assert resumed == pytest.approx(whole[SAVE_AT:], rel=1e-5)
