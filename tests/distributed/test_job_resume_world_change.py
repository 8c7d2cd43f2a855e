"""A DDP Job saved mid-epoch at one world size resumes at another and finishes the epoch (issue 35).

A job of 4 ranks saves after step 3 of its first epoch and stops (a host lost). The job goes on
at 2 ranks from that checkpoint (it saves again mid-epoch, after step 5, a copy of which is
kept), and a third run goes on at 3 ranks from that copy. Each rank records the dataset
indices of every batch it trains. Over the runs that make up an epoch, every sample is trained
exactly once, plus the padding of the epoch's last step (the first entries of the epoch's
permutation, as torch pads); each step trains the next entries of the epoch's permutation; and
the step count goes on from the saved step to the number the remaining batches take.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

import phalanx
from phalanx.data.elastic_plan import epoch_order
from phalanx.testing import run_distributed
from phalanx.train.job_data import DATA_SEED

N = 46
"""Samples: at 4 ranks x 2, 6 steps an epoch with 2 padded; the rest after 3 steps (22) at 2
ranks takes 6 steps (2 padded); the rest after 2 more (14) at 3 ranks, 3 steps (4 padded)."""
BATCH = 2
EPOCHS = 2


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, 4, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True), torch.arange(N))


def _train(ckpt: str, stop_at: int | None, keep_at: int | None, keep: str) -> dict[str, Any]:
    """Train ``EPOCHS`` epochs from the newest checkpoint in ``ckpt``: save and stop after step
    ``stop_at``, or save and copy to ``keep`` after step ``keep_at``, going on."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    job = phalanx.Job(strategy="ddp", checkpoint_dir=ckpt, straggler_check_every=0)
    model = nn.Linear(4, 1)
    model, _ = job.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
    loader = job.loader(_data(), batch_size=BATCH)
    trained: list[tuple[int, int, list[int]]] = []  # (epoch, step number, indices)
    resumed_at = None
    for epoch in job.epochs(EPOCHS):
        resumed_at = job.step_count if resumed_at is None else resumed_at
        for x, y, idx in job.progress(loader):
            job.backward(nn.functional.mse_loss(model(x), y))
            job.step()
            trained.append((epoch, job.step_count, idx.tolist()))
            if job.step_count in (stop_at, keep_at):
                path = job.save(async_=False)
                if job.step_count == keep_at and job.world.is_main:
                    shutil.copytree(path, Path(keep) / path.name)
            if job.step_count == stop_at:
                break
        if job.step_count == stop_at:
            break
    params = [p.detach().clone() for p in model.parameters()]
    out = {"trained": trained, "resumed_at": resumed_at, "steps": job.step_count}
    out["params"] = params
    job.close()
    return out


def _by_step(ranks: list[dict[str, Any]]) -> dict[tuple[int, int], list[int]]:
    """(epoch, step) -> the indices every rank trained in that step."""
    steps: dict[tuple[int, int], list[int]] = {}
    for rank in ranks:
        assert rank["params"] is not None
        for epoch, step, idx in rank["trained"]:
            steps.setdefault((epoch, step), []).extend(idx)
    return steps


def _check_run(steps: dict[tuple[int, int], list[int]], worlds: list[tuple[int, int, int]]) -> None:
    """Each step of epoch 0 trains the next entries of the epoch's permutation (``worlds``: the
    world size, first and last step of each run), padded with its first entries; each epoch's
    samples are each trained once plus that padding."""
    order = epoch_order(N, DATA_SEED, 0, True).tolist()
    entry = 0
    for world, first, last in worlds:
        for step in range(first, last + 1):
            want = [order[p % N] for p in range(entry, entry + world * BATCH)]
            assert Counter(steps[(0, step)]) == Counter(want), f"epoch 0, step {step}"
            entry += world * BATCH
    padding = entry - N
    assert 0 <= padding < worlds[-1][0] * BATCH
    for epoch in range(EPOCHS):
        seen = Counter(i for (e, _), idx in steps.items() if e == epoch for i in idx)
        extra = seen - Counter(range(N))
        assert set(seen) == set(range(N)), f"epoch {epoch}: a sample skipped"
        first = epoch_order(N, DATA_SEED, epoch, True).tolist()
        pad = padding if epoch == 0 else -N % (worlds[-1][0] * BATCH)
        assert extra == Counter(first[:pad]), f"epoch {epoch}: duplicates besides the padding"


def _replicas_equal(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks[1:]:
        for got, want in zip(rank["params"], ranks[0]["params"]):
            assert torch.equal(got, want)


def test_ddp_job_saved_mid_epoch_at_4_resumes_at_2_then_3(tmp_path: Path) -> None:
    ckpt, keep = tmp_path / "ckpt", tmp_path / "kept"
    keep.mkdir()
    four = run_distributed(_train, str(ckpt), 3, None, "", world_size=4, timeout=180)
    assert {r["steps"] for r in four} == {3}
    two = run_distributed(_train, str(ckpt), None, 5, str(keep), world_size=2, timeout=180)
    three = run_distributed(_train, str(keep), None, None, "", world_size=3, timeout=180)

    # 4 ranks: steps 1-3. At 2 ranks: epoch 0 goes on at step 4 and takes 6 more steps (22
    # samples left, 4 a step), epoch 1 12 (46 samples, 4 a step): 3 + 6 + 12 = 21.
    assert {r["resumed_at"] for r in two} == {3} and {r["steps"] for r in two} == {21}
    both = {**_by_step(four), **_by_step(two)}
    _check_run(both, [(4, 1, 3), (2, 4, 9)])
    # From the copy of step 5 (entries 0..31 trained) at 3 ranks: 14 left, 6 a step, 3 steps
    # (4 padded); epoch 1 8 steps (48 of 46 dealt): 5 + 3 + 8 = 16.
    assert {r["resumed_at"] for r in three} == {5} and {r["steps"] for r in three} == {16}
    upto5 = {k: v for k, v in both.items() if k[1] <= 5}
    _check_run({**upto5, **_by_step(three)}, [(4, 1, 3), (2, 4, 5), (3, 6, 8)])
    _replicas_equal(two)
    _replicas_equal(three)
