"""Hogwild: processes share one model's storage, learn digits, fail loudly and on time."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time

import pytest
import torch
from torch import nn

import phalanx.hogwild as hogwild
from phalanx.launch import SpawnError

FAST = {"start_method": "forkserver"}  # torch preloaded once: children start in ~0.1 s
K = 50  # writes per process into its slot of the shared parameter


class Slots(nn.Module):
    """One parameter slot and one buffer slot per process."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n))
        self.register_buffer("pids", torch.zeros(n, dtype=torch.float64))
        self.register_buffer("setup", torch.zeros(n, 2, dtype=torch.int64))  # seed, threads


def _wait_until(cond: object, what: str, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"never saw {what}: storage is not shared")
        time.sleep(0.005)


def _write_slots(rank: int, model: Slots, shard: object, k: int) -> None:
    model.pids[rank] = os.getpid()
    model.setup[rank] = torch.tensor([torch.initial_seed(), torch.get_num_threads()])
    if rank == 1:  # sees rank 0's writes only if the two children share the storage
        _wait_until(lambda: model.weight[0].item() == k, "rank 0's writes in rank 1")
    with torch.no_grad():
        for _ in range(k):
            model.weight[rank] += rank + 1
    if rank == 0:
        _wait_until(lambda: model.weight[1].item() == 2 * k, "rank 1's writes in rank 0")


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_processes_write_the_parents_storage(start_method: str) -> None:
    model = Slots(2)
    weight = model.weight
    out = hogwild.train(
        model, _write_slots, 2, args=(K,), start_method=start_method, timeout=60, seed=7
    )
    assert out is model and model.weight is weight  # the same Parameter, now in shared memory
    assert model.weight.is_shared() and model.pids.is_shared()
    # Each process owns one slot (no race), so the sums are exact; the parent never wrote.
    assert model.weight.tolist() == [1.0 * K, 2.0 * K]
    pids = [int(p) for p in model.pids.tolist()]
    assert len(set(pids)) == 2 and os.getpid() not in pids and 0 not in pids
    assert model.setup.tolist() == [[7, 1], [8, 1]]  # seed + rank, one thread each


def _digits() -> tuple[torch.utils.data.TensorDataset, tuple[torch.Tensor, torch.Tensor]]:
    from phalanx.datasets import digits

    x, y = digits()  # scikit-learn's, without importing scikit-learn
    xs, ys = torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y)
    order = torch.randperm(len(ys), generator=torch.Generator().manual_seed(0))
    train, test = order[:1437], order[1437:]
    return torch.utils.data.TensorDataset(xs[train], ys[train]), (xs[test], ys[test])


def _train_digits(rank: int, model: nn.Module, shard: torch.utils.data.Subset, epochs: int) -> None:
    assert len(shard) in (718, 719)  # 1437 samples split by rank, DistributedSampler-style
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    loader = torch.utils.data.DataLoader(shard, batch_size=16, shuffle=True)
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()


def test_two_processes_learn_digits() -> None:
    torch.manual_seed(0)
    train_set, (x_test, y_test) = _digits()
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    before = [p.detach().clone() for p in model.parameters()]
    hogwild.train(model, _train_digits, 2, dataset=train_set, args=(15,), timeout=120, **FAST)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    assert accuracy >= 0.95, accuracy


def _fail_on_rank_1(rank: int, model: Slots, shard: object, how: str) -> None:
    model.pids[rank] = os.getpid()
    if rank == 0:
        time.sleep(60)  # must be stopped by the parent, long before this returns
    _wait_until(lambda: model.pids[0].item() != 0, "rank 0's pid")
    if how == "raise":
        raise ValueError("boom from the test")
    if how == "exit":
        sys.exit(3)
    os.kill(os.getpid(), signal.SIGKILL)


def _assert_all_dead(model: Slots) -> None:
    assert multiprocessing.active_children() == []
    for pid in model.pids.tolist():
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid), 0)


@pytest.mark.parametrize(
    ("how", "expected"),
    [("raise", "ValueError: boom from the test"), ("exit", "code 3"), ("kill", "SIGKILL")],
)
def test_failing_rank_is_named_and_peers_are_killed(how: str, expected: str) -> None:
    model = Slots(2)
    with pytest.raises(SpawnError, match="rank 1 failed") as info:
        hogwild.train(model, _fail_on_rank_1, 2, args=(how,), timeout=30, **FAST)
    assert info.value.rank == 1 and expected in str(info.value)
    if how == "raise":
        assert "Traceback" in str(info.value) and "_fail_on_rank_1" in str(info.value)
    _assert_all_dead(model)


def _sleep(rank: int, model: Slots, shard: object) -> None:
    model.pids[rank] = os.getpid()
    time.sleep(60)


def test_timeout_kills_every_process() -> None:
    model = Slots(2)
    with pytest.raises(SpawnError, match="timed out"):
        hogwild.train(model, _sleep, 2, timeout=3, **FAST)
    assert all(p != 0 for p in model.pids.tolist())  # both had started before the deadline
    _assert_all_dead(model)


def test_shards_split_like_distributed_sampler() -> None:
    shards = [hogwild.shard_indices(7, r, 3) for r in range(3)]
    assert shards == [[0, 3, 6], [1, 4], [2, 5]]
    assert hogwild.shard_indices(1, 1, 2) == []
    with pytest.raises(ValueError, match="rank=2, num_processes=2"):
        hogwild.shard_indices(4, 2, 2)


def test_bad_arguments_are_refused_before_any_process_starts() -> None:
    model = Slots(2)
    with pytest.raises(ValueError, match=r"fork.*deadlock.*spawn"):
        hogwild.train(model, _sleep, 2, start_method="fork")
    with pytest.raises(ValueError, match="start_method must be one of"):
        hogwild.train(model, _sleep, 2, start_method="threads")
    with pytest.raises(ValueError, match="num_processes=0"):
        hogwild.train(model, _sleep, 0)
    with pytest.raises(ValueError, match="timeout=0"):
        hogwild.train(model, _sleep, 1, timeout=0)
    with pytest.raises(TypeError, match=r"train_fn=.*lambda"):
        hogwild.train(model, lambda *a: None, 2)

    def local(rank: int, model: nn.Module, shard: object) -> None: ...

    with pytest.raises(TypeError, match=r"train_fn=.*local"):
        hogwild.train(model, local, 2)
    with pytest.raises(TypeError, match="dataset must be a map-style dataset"):
        hogwild.train(model, _sleep, 2, dataset=iter([1, 2]))  # type: ignore[arg-type]
    assert multiprocessing.active_children() == []
