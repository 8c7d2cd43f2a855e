"""Exact evaluation on real ranks: ``job.loader(eval=True)`` reads each sample once and
``job.gather`` brings every replica's outputs back in order, so metrics equal one process's."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import phalanx
from phalanx.testing import run_distributed

N = 5  # samples: 2 ranks cannot split them evenly


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 3, generator=g)
    return TensorDataset(torch.arange(N), x, torch.randint(0, 2, (N,), generator=g))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def _evaluate(shuffle: bool) -> dict[str, object]:
    job = phalanx.Job("ddp")
    model, _ = job.setup(_model())
    ids, preds, labels, batches = [], [], [], 0
    with torch.no_grad():
        for i, x, y in job.progress(job.loader(_data(), 2, eval=True, shuffle=shuffle)):
            ids.append(i)
            preds.append(model(x).argmax(1))
            labels.append(y)
            batches += 1
    mine = torch.cat(ids)
    got = {
        "mine": mine.tolist(),
        "batches": batches,
        "ids": job.gather(mine).tolist(),
        "correct": job.gather((torch.cat(preds) == torch.cat(labels)).sum().item()),
        "preds": job.gather(torch.cat(preds)).tolist(),
        "flags": job.gather(job.world.rank == 0),
    }
    try:
        job.gather(torch.zeros(1, 2 + job.world.rank))
    except ValueError as exc:
        got["mismatch"] = str(exc)
    job.close()
    return got


@pytest.mark.parametrize("shuffle", [False, True])
def test_eval_over_5_samples_on_2_ranks_sees_each_once(shuffle: bool) -> None:
    results = run_distributed(_evaluate, shuffle, world_size=2)
    seen = [i for r in results for i in r["mine"]]  # type: ignore[attr-defined]
    assert sorted(seen) == list(range(N)), f"each sample exactly once, got {seen}"
    assert [len(r["mine"]) for r in results] == [3, 2]  # type: ignore[arg-type]
    assert [r["batches"] for r in results] == [2, 1], "uneven batches, no padding"
    _, x, y = _data().tensors
    want = _model()(x).argmax(1)
    for r in results:
        assert r["ids"] == seen, "gathered in rank order, the same on every rank"
        if not shuffle:
            assert r["ids"] == list(range(N)), "in the dataset's order"
        assert r["preds"] == want[r["ids"]].tolist()
        assert sum(r["correct"]) == int((want == y).sum()), "the single-process metric"  # type: ignore[arg-type]
        assert r["flags"] == [True, False]
        assert "dimension but the first" in str(r["mismatch"])
        assert "[1, 2]" in str(r["mismatch"]) and "[1, 3]" in str(r["mismatch"])


def _mesh_eval() -> tuple[list[int], list[int]]:
    job = phalanx.Job(phalanx.Mesh(tp=2))  # dp = 1: both ranks are one replica
    loader = job.loader(_data(), 2, eval=True)
    mine = torch.cat([i for i, _, _ in loader])
    gathered = job.gather(mine)
    job.close()
    return mine.tolist(), gathered.tolist()  # type: ignore[union-attr]


def test_ranks_of_one_replica_read_the_same_samples_and_gather_over_dp() -> None:
    for mine, gathered in run_distributed(_mesh_eval, world_size=2):
        assert mine == gathered == list(range(N))


def _ps_eval() -> list[int] | None:
    job = phalanx.Job(phalanx.PS(mode="sync"))
    net = _model()
    model, _ = job.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for _ in job.epochs(1):  # servers serve here until the workers are done
        for _, x, y in job.progress(job.loader(_data(), 2)):
            job.backward(nn.functional.cross_entropy(model(x), y))
            job.step()
    ids = [i for i, _, _ in job.progress(job.loader(_data(), 2, eval=True))]
    gathered = None if job.is_server else job.gather(torch.cat(ids)).tolist()  # type: ignore[union-attr]
    job.close()
    return gathered


def test_parameter_server_workers_evaluate_after_training() -> None:
    server, *workers = run_distributed(_ps_eval, world_size=3, timeout=120)
    assert server is None and workers == [list(range(N))] * 2
