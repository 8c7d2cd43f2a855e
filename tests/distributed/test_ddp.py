"""DistributedDataParallel parity: replicas bit-identical, equal to one process on the full batch.

Tolerance: replicas must be bit-identical to each other (same reduced bytes, same optimizer);
against the single-process reference they differ only by floating-point reassociation of the mean
(per-rank partial sums, bucket division before the sum), so rtol=1e-5, atol=1e-6.
The same cases run with torch's DDP swapped in, which shows the tests test behaviour.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

import phalanx
from phalanx.testing import run_distributed
from tests.distributed import ddp_cases as dc


def _wrap(impl: str, model: nn.Module, case: dict[str, Any]) -> Any:
    kwargs = {
        "find_unused_parameters": case.get("unused", False),
        "gradient_as_bucket_view": case.get("bucket_view", False),
        "bucket_cap_mb": case.get("bucket_cap_mb", 25),
    }
    if impl == "torch":
        return torch.nn.parallel.DistributedDataParallel(model, **kwargs)
    return phalanx.DistributedDataParallel(model, **kwargs)


def _train(impl: str, name: str) -> list[torch.Tensor]:
    case = dc.CASES[name]
    rank = phalanx.world().rank
    model = dc.make_model(case, seed=rank)  # different on purpose: wrapping broadcasts rank 0's
    ddp = _wrap(impl, model, case)
    opt = dc.make_optimizer(case, ddp.parameters())
    accum = case.get("accum", 1)
    for step in range(dc.STEPS):
        opt.zero_grad()
        for micro in range(accum):
            x, y = dc.batch(case, step, micro, rank)
            sync = micro == accum - 1
            ctx = ddp.no_sync() if not sync else _nullcontext()
            with ctx:
                loss = nn.functional.cross_entropy(ddp(x), y) / accum
                loss.backward()
        opt.step()
    module = ddp.module
    return [t.detach().clone() for t in [*module.parameters(), *module.buffers()]]


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _all_cases(impl: str) -> dict[str, list[torch.Tensor]]:
    return {name: _train(impl, name) for name in dc.CASES}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("impl", ["phalanx", "torch"])
def test_parity_with_single_process(impl: str, world_size: int) -> None:
    results = run_distributed(_all_cases, impl, world_size=world_size, timeout=120)
    for name, case in dc.CASES.items():
        ref = dc.reference(case, world_size)
        n_params = len(list(dc.make_model(case, 0).parameters()))  # buffers follow; they
        for rank in range(1, world_size):  # stay per-rank until the next forward syncs them
            for a, b in zip(results[0][name][:n_params], results[rank][name][:n_params]):
                assert torch.equal(a, b), f"{impl} {name}: rank {rank} differs from rank 0"
        for i, (got, want) in enumerate(zip(results[0][name], ref)):
            torch.testing.assert_close(
                got, want, rtol=1e-5, atol=1e-6, msg=f"{impl} {name}: tensor {i} differs"
            )


def _collectives_per_step() -> tuple[int, int, int]:
    model = dc.MLP()
    ddp = phalanx.DistributedDataParallel(model, bucket_cap_mb=0.002)
    x, y = dc.batch({"opt": "sgd"}, 0, 0, phalanx.world().rank)
    nn.functional.cross_entropy(ddp(x), y).backward()  # warm-up
    phalanx.reset_comm_stats()
    for _ in range(3):
        nn.functional.cross_entropy(ddp(x), y).backward()
    calls = phalanx.comm_stats()["all_reduce"][0]
    return calls, 3 * len(ddp.reducer.buckets), len(ddp.reducer.buckets)


def test_all_reduce_calls_per_step_equal_bucket_count() -> None:
    for calls, expected, buckets in run_distributed(_collectives_per_step):
        assert buckets > 1
        assert calls == expected


def _unused_without_flag() -> str:
    ddp = phalanx.DistributedDataParallel(dc.MLP(unused=True))
    x, y = dc.batch({"opt": "sgd"}, 0, 0, phalanx.world().rank)
    try:
        nn.functional.cross_entropy(ddp(x), y).backward()
    except RuntimeError as exc:
        return str(exc)
    return ""


def test_unused_parameter_error_names_the_parameters() -> None:
    for rank, msg in enumerate(run_distributed(_unused_without_flag)):
        assert f"[rank {rank}]" in msg
        assert "'spare.weight', 'spare.bias'" in msg
        assert "find_unused_parameters=True" in msg


def _mismatched_models() -> str:
    hidden = 32 if phalanx.world().rank == 0 else 16
    try:
        phalanx.DistributedDataParallel(dc.MLP(hidden=hidden))
    except RuntimeError as exc:  # torch's type for this mistake
        return str(exc)
    return ""


def test_mismatched_models_name_rank_parameter_and_shapes() -> None:
    for msg in run_distributed(_mismatched_models):
        assert "model on rank 1 differs" in msg
        assert "'fc1.weight' has shape [32, 10]" in msg and "[16, 10]" in msg


def _bad_hook() -> str:
    ddp = phalanx.DistributedDataParallel(dc.MLP())

    def hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer()[:3])
        return fut

    ddp.register_comm_hook(None, hook)
    x, y = dc.batch({"opt": "sgd"}, 0, 0, phalanx.world().rank)
    try:
        nn.functional.cross_entropy(ddp(x), y).backward()
    except ValueError as exc:
        return str(exc)
    return ""


def test_comm_hook_with_wrong_shape_is_named() -> None:
    for msg in run_distributed(_bad_hook):
        assert "communication hook returned (3,)" in msg and "expected a tensor of shape" in msg


def _uneven_join(impl: str, model_kind: str, divide: bool, zero: bool) -> list[torch.Tensor]:
    """Rank 1 has two more batches than rank 0; the whole job under one Join context."""
    from torch.distributed.algorithms.join import Join
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    rank = phalanx.world().rank
    case = {"opt": "sgd", "model": model_kind}
    model = dc.make_model(case, seed=0)
    cls = (
        torch.nn.parallel.DistributedDataParallel
        if impl == "torch"
        else phalanx.DistributedDataParallel
    )
    ddp: Any = cls(model)
    if zero:
        opt: Any = TorchZero(ddp.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
        ctx: Any = Join([ddp, opt], divide_by_initial_world_size=divide)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        ctx = ddp.join(divide_by_initial_world_size=divide)
    start = time.monotonic()
    with ctx:
        for step in range(3 + 2 * rank):
            opt.zero_grad()
            x, y = dc.batch(case, step, 0, rank)
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
    assert time.monotonic() - start < 30
    return [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]


JOIN_CONFIGS = [
    ("mlp", True, False),
    ("mlp", False, False),
    ("cnn", True, False),  # BatchNorm: buffers follow a rank still training
    ("mlp", True, True),  # one Join over phalanx's DDP and torch's ZeroRedundancyOptimizer
]


def _join_both() -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    return [
        (_uneven_join("torch", *config), _uneven_join("phalanx", *config))
        for config in JOIN_CONFIGS
    ]


def test_join_matches_torch_on_uneven_inputs() -> None:
    """phalanx's Joinable DDP ends where torch's does: same shadowing, divisor, final sync."""
    per_rank = run_distributed(_join_both, timeout=120)
    for config, (torch_0, ours_0), (_, ours_1) in zip(JOIN_CONFIGS, *per_rank):
        for a, b, d in zip(torch_0, ours_0, ours_1):
            assert torch.equal(b, d), f"{config}: ranks differ"
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=f"{config}: not torch's")
