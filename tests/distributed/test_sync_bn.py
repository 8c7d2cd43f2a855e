"""SyncBatchNorm on 2 and 3 gloo ranks with uneven (and empty) batches vs one-process BatchNorm.

Every rank cuts its slice out of the same seeded global batch and trains a few SGD steps (weight
and bias gradients summed over ranks, as data parallel would); the parent replays the steps with
``nn.BatchNormXd`` on the concatenated batch and compares outputs, input gradients, parameter
gradients, running statistics and the eval-mode output.

Tolerances: float32 compares use rtol=atol=1e-5. The one-process reference reduces each channel in
one pass, the ranks reduce partial sums and then add them (in float64): the same numbers summed in a
different order, so results differ by a few ulps of O(1) values, amplified a little in the input
gradient (a difference of three terms). bf16 input compares against the float32 reference with
bf16's resolution (2^-8 relative): rtol=atol=2e-2.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import phalanx
from phalanx.data_parallel.sync_bn import SyncBatchNorm
from phalanx.testing import run_distributed

STEPS = 3
LR = 0.1
FP32 = {"rtol": 1e-5, "atol": 1e-5}
BF16 = {"rtol": 2e-2, "atol": 2e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    sample_shape: tuple[int, ...]  # (C, *spatial)
    kwargs: tuple[tuple[str, Any], ...] = ()
    channels_last: bool = False
    dtype: torch.dtype = torch.float32

    @property
    def reference_cls(self) -> type[nn.Module]:
        return {1: nn.BatchNorm1d, 2: nn.BatchNorm1d, 3: nn.BatchNorm2d, 4: nn.BatchNorm3d}[
            len(self.sample_shape)
        ]


CASES = [
    Case("bn2d", (4, 3, 3)),
    Case("bn2d_channels_last_cumulative", (4, 3, 3), (("momentum", None),), channels_last=True),
    Case("bn1d_NC", (6,)),
    Case("bn1d_NCL", (5, 4)),
    Case("bn3d", (3, 2, 2, 2)),
    Case("no_affine", (4, 3, 3), (("affine", False),)),
    Case("no_running_stats", (4, 3, 3), (("track_running_stats", False),)),
    Case("bf16_input", (4, 3, 3), dtype=torch.bfloat16),
]
EMPTY_RANK_CASES = [CASES[0], CASES[2]]


def _batch(case: Case, step: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch and loss weights of ``step``: channel means far from 0 on purpose."""
    gen = torch.Generator().manual_seed(1000 * step + len(case.name))
    shape = (total, *case.sample_shape)
    offset = _per_channel(torch.arange(case.sample_shape[0]) * 3.0 - 2.0, len(shape))
    x = torch.randn(shape, generator=gen) * 2.0 + offset
    return x.to(case.dtype).float(), torch.randn(shape, generator=gen)


def _per_channel(v: torch.Tensor, ndim: int) -> torch.Tensor:
    return v.view(1, -1, *([1] * (ndim - 2)))


def _make_bn(case: Case, cls: type[nn.Module]) -> nn.Module:
    bn = cls(case.sample_shape[0], **dict(case.kwargs))
    with torch.no_grad():
        if bn.weight is not None:
            bn.weight.copy_(torch.linspace(0.5, 1.5, bn.num_features))
            bn.bias.copy_(torch.linspace(-1.0, 1.0, bn.num_features))
    return bn


def _step(
    case: Case, bn: nn.Module, x: torch.Tensor, g: torch.Tensor, dtype: torch.dtype
) -> dict[str, Any]:
    if case.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x = x.to(dtype).requires_grad_()
    y = bn(x)
    (y.float() * g).sum().backward()
    rec = {"y": y.detach(), "dx": x.grad, "channels_last": _is_channels_last(y)}
    if bn.weight is not None:
        rec.update(dw=bn.weight.grad.clone(), db=bn.bias.grad.clone())
    return rec


def _is_channels_last(y: torch.Tensor) -> bool:
    return y.dim() == 4 and y.is_contiguous(memory_format=torch.channels_last)


def _sgd(bn: nn.Module, distributed: bool) -> None:
    for p in bn.parameters():
        if distributed:  # the full-batch loss is the sum of the local ones
            dist.all_reduce(p.grad)
        with torch.no_grad():
            p.sub_(LR * p.grad)
        p.grad = None


def _run_case(case: Case, sizes: list[int], rank: int | None) -> dict[str, Any]:
    """Train STEPS steps on this rank's slice (``rank=None``: the whole batch, plain BatchNorm)."""
    lo = 0 if rank is None else sum(sizes[:rank])
    hi = sum(sizes) if rank is None else lo + sizes[rank]
    bn = _make_bn(case, case.reference_cls if rank is None else SyncBatchNorm)
    dtype = torch.float32 if rank is None else case.dtype  # the reference runs in float32
    steps = []
    for step in range(STEPS):
        x, g = _batch(case, step, sum(sizes))
        steps.append(_step(case, bn, x[lo:hi], g[lo:hi], dtype))
        _sgd(bn, rank is not None)
    bn.eval()
    x_eval = _batch(case, STEPS, sum(sizes))[0][lo:hi].to(dtype)
    with torch.no_grad():
        y_eval = bn(x_eval) if case.kwargs != (("track_running_stats", False),) else None
    return {"steps": steps, "eval": y_eval, "state": bn.state_dict()}


def _ranks_run_cases(groups: list[tuple[list[int], list[Case]]]) -> list[list[dict[str, Any]]]:
    rank = phalanx.world().rank
    return [[_run_case(c, sizes, rank) for c in cases] for sizes, cases in groups]


def _ranks_count_collectives(sizes: list[int]) -> dict[str, tuple[int, int]]:
    bn = SyncBatchNorm(4).double()
    x = torch.randn(sizes[phalanx.world().rank], 4, 3, 3, dtype=torch.float64, requires_grad=True)
    phalanx.reset_comm_stats()
    bn(x).sum().backward()
    counts = phalanx.comm_stats()
    with torch.no_grad():
        bn.eval()(x)  # eval mode: running statistics, no communication
    assert phalanx.comm_stats() == counts
    return counts


def _compare(case: Case, sizes: list[int], by_rank: list[dict[str, Any]]) -> None:
    ref = _run_case(case, sizes, None)
    tol = BF16 if case.dtype == torch.bfloat16 else FP32
    for step, want in enumerate(ref["steps"]):
        got = [r["steps"][step] for r in by_rank]
        for key in ("y", "dx"):
            actual = torch.cat([g[key].float() for g in got])
            torch.testing.assert_close(actual, want[key].float(), **tol, msg=f"{key} @ {step}")
        for key in ("dw", "db"):
            if key in want:  # local parameter gradients sum to the full-batch gradient
                total = torch.stack([g[key] for g in got]).sum(0)
                torch.testing.assert_close(total, want[key], **tol, msg=f"{key} @ {step}")
        assert all(g["channels_last"] == case.channels_last for g in got if g["y"].numel())
    if ref["eval"] is not None:
        actual = torch.cat([r["eval"].float() for r in by_rank])
        torch.testing.assert_close(actual, ref["eval"].float(), **tol)
    for r in by_rank:
        torch.testing.assert_close(r["state"], ref["state"], **tol)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # The references use tiny tensors: with torch's intra-op pool on a loaded 2-core machine
    # they run ~25x slower than on one thread.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _ranks_do(calls: list[tuple[Any, tuple[Any, ...]]]) -> list[Any]:
    """Several jobs in one launch: starting ranks costs more than the jobs themselves."""
    return [fn(*args) for fn, args in calls]


TWO_RANK_GROUPS = [([3, 5], CASES)]
CNN_SIZES = [5, 3]


@pytest.fixture(scope="module")
def two_ranks() -> list[list[Any]]:
    calls = [
        (_ranks_run_cases, (TWO_RANK_GROUPS,)),
        (_ranks_train_cnn, (CNN_SIZES,)),
        (_ranks_count_collectives, ([0, 3],)),
    ]
    by_rank = run_distributed(_ranks_do, calls, world_size=2)
    return [list(job) for job in zip(*by_rank)]  # by job, then by rank


def _check_all(groups: list[tuple[list[int], list[Case]]], by_rank: list[Any]) -> None:
    for g, (sizes, cases) in enumerate(groups):
        for c, case in enumerate(cases):
            _compare(case, sizes, [r[g][c] for r in by_rank])


def test_two_ranks_uneven_batches_match_one_process(two_ranks: list[list[Any]]) -> None:
    _check_all(TWO_RANK_GROUPS, two_ranks[0])


THREE_RANK_GROUPS = [([3, 5, 1], CASES), ([4, 0, 3], EMPTY_RANK_CASES)]


@pytest.fixture(scope="module")
def three_ranks() -> list[list[Any]]:
    calls = [(_ranks_run_cases, (THREE_RANK_GROUPS,)), (_ranks_subgroups, ())]
    by_rank = run_distributed(_ranks_do, calls, world_size=3)
    return [list(job) for job in zip(*by_rank)]


def test_three_ranks_uneven_and_empty_batches_match_one_process(
    three_ranks: list[list[Any]],
) -> None:
    _check_all(THREE_RANK_GROUPS, three_ranks[0])


def _subgroup_batch() -> torch.Tensor:
    return torch.randn(6, 2, 3, generator=torch.Generator().manual_seed(5)) * 3 + 1


def _ranks_subgroups() -> tuple[torch.Tensor, dict[str, tuple[int, int]]]:
    rank = phalanx.world().rank
    pair, alone = dist.new_group([0, 1]), dist.new_group([2])  # every rank creates every group
    bn = SyncBatchNorm(2, process_group=pair if rank < 2 else alone)
    phalanx.reset_comm_stats()
    y = bn(_subgroup_batch()[2 * rank : 2 * rank + 2])
    return y.detach(), phalanx.comm_stats()


def test_process_group_scopes_the_statistics(three_ranks: list[list[Any]]) -> None:
    (y0, c0), (y1, c1), (y2, c2) = three_ranks[1]
    x = _subgroup_batch()
    torch.testing.assert_close(torch.cat([y0, y1]), nn.BatchNorm1d(2)(x[:4]), **FP32)
    assert c0 == c1 == {"all_reduce": (1, 8 * 5)}  # forward only: [2C+1] float64
    # a group of one is plain BatchNorm, without communication
    torch.testing.assert_close(y2, nn.BatchNorm1d(2)(x[4:]), **FP32)
    assert c2 == {}


def test_one_all_reduce_forward_and_one_backward_even_for_an_empty_batch(
    two_ranks: list[list[Any]],
) -> None:
    # forward [2C+1] float64 = 72 bytes; backward [2C] float64 = 64 bytes; both on both ranks,
    # rank 0 with an empty batch
    assert two_ranks[2] == [{"all_reduce": (2, 72 + 64)}] * 2


# --- convert_sync_batchnorm ------------------------------------------------------------------


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=None))
        self.head = nn.Sequential(nn.Flatten(), nn.BatchNorm1d(4 * 16), nn.Linear(4 * 16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.block(self.stem(x))))


def _cnn_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x, g = torch.randn(8, 3, 4, 4, generator=gen), torch.randn(8, 3, generator=gen)
    return x.double(), g.double()


def _train_cnn(sizes: list[int], rank: int | None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = SmallCNN().double()
    if rank is not None:
        model = SyncBatchNorm.convert_sync_batchnorm(model)
    lo = 0 if rank is None else sum(sizes[:rank])
    hi = sum(sizes) if rank is None else lo + sizes[rank]
    for step in range(STEPS):
        x, g = _cnn_batch(step)
        (model(x[lo:hi]) * g[lo:hi]).sum().backward()
        _sgd(model, rank is not None)
    return model.state_dict()


def _ranks_train_cnn(sizes: list[int]) -> dict[str, torch.Tensor]:
    return _train_cnn(sizes, phalanx.world().rank)


def test_converted_cnn_trains_like_the_original_on_the_full_batch(
    two_ranks: list[list[Any]],
) -> None:
    want = _train_cnn(CNN_SIZES, None)
    for state in two_ranks[1]:
        # float64: BatchNorm1d over 8 samples after a ReLU has near-constant features whose tiny
        # variance amplifies float32 reassociation noise across SGD steps past any fair float32
        # tolerance; in float64 the same noise stays ~1e-12, so any real error would stand out.
        torch.testing.assert_close(state, want, rtol=1e-9, atol=1e-9)


def test_convert_replaces_types_and_carries_state() -> None:
    model = SmallCNN()
    model.stem[1].weight.requires_grad_(False)
    model.block[1].eval()
    with torch.no_grad():
        model.stem[1].running_mean.fill_(0.25)
    model.stem[1].num_batches_tracked.fill_(7)
    before = {k: v for k, v in model.state_dict(keep_vars=True).items()}
    group = dist.ProcessGroup(0, 1)  # a group with no backend: conversion only stores it
    converted = SyncBatchNorm.convert_sync_batchnorm(model, process_group=group)
    assert converted is model
    bns = [model.stem[1], model.block[1], model.head[1]]
    assert all(type(m) is SyncBatchNorm and m.process_group is group for m in bns)
    assert model.block[1].momentum is None and model.head[1].num_features == 64
    after = model.state_dict(keep_vars=True)
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before)  # the very same tensors
    assert not model.stem[1].weight.requires_grad and model.stem[1].bias.requires_grad
    assert [m.training for m in bns] == [True, False, True]


def test_convert_a_bare_batchnorm_returns_a_new_layer() -> None:
    bn = nn.BatchNorm1d(3, affine=False, track_running_stats=False)
    sync = SyncBatchNorm.convert_sync_batchnorm(bn)
    assert isinstance(sync, SyncBatchNorm) and sync is not bn
    assert sync.weight is None and sync.running_mean is None
    assert SyncBatchNorm.convert_sync_batchnorm(sync) is sync


# --- one process: no group means plain BatchNorm -----------------------------------------------


def test_without_a_process_group_it_is_exactly_batchnorm() -> None:
    assert not dist.is_initialized()
    torch.manual_seed(0)
    x = torch.randn(6, 3, 4, 4) + 2.0
    ref, sync = nn.BatchNorm2d(3), SyncBatchNorm(3)
    outs = []
    for bn in (ref, sync):
        xi = x.clone().requires_grad_()
        y = bn(xi)
        (y * y).sum().backward()
        outs.append((y, xi.grad, bn.weight.grad, bn.state_dict()))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)  # the same code path


@pytest.mark.parametrize(
    ("shape", "match"),
    [((4,), r"\(N, 3, \.\.\.\).*got \(4,\)"), ((2, 5, 4), r"\(N, 3, \.\.\.\).*got \(2, 5, 4\)")],
)
def test_bad_input_shape_names_expected_and_actual(shape: tuple[int, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SyncBatchNorm(3)(torch.randn(shape))
