"""Communication hooks on 2 gloo ranks: exact means, error bounds, bytes, and torch's DDP.

Part (a) drives each hook on a hand-built ``GradBucket`` of per-rank random gradients shaped like
a ~3.9 M-parameter MLP. Part (b) registers each hook on torch's and on phalanx's
``DistributedDataParallel`` and trains a small classifier on scikit-learn's handwritten digits;
every hook must end within 2 accuracy points of training without one.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
import torch.distributed as dist

import phalanx
from phalanx.data_parallel.grad_bucket import GradBucket
from phalanx.data_parallel.hooks import (
    PowerSGDState,
    TopKState,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
    powerSGD_hook,
    topk_hook,
)
from phalanx.data_parallel.hooks.topk import topk_select
from phalanx.testing import run_distributed

# An MLP's gradients, weight then bias per layer: 3,934,976 entries (15.7 MB in fp32).
LAYERS = [(1024, 2048), (1024, 1024), (512, 1024), (256, 1024)]
MLP_SHAPES: list[tuple[int, ...]] = [s for n, m in LAYERS for s in ((n, m), (n,))]
NUMEL = 3_934_976
WORLD = 2


def _grads(step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s flat gradient at ``step``; every rank can compute every rank's."""
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 * step + rank))


def _bucket(flat: torch.Tensor) -> GradBucket:
    views, offset = [], 0
    for shape in MLP_SHAPES:
        n = torch.Size(shape).numel()
        views.append(flat[offset : offset + n].view(shape))
        offset += n
    return GradBucket(0, flat, views, [torch.empty(0)] * len(views), True)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.numpy().tobytes()).hexdigest()


def _run(hook: Any, state: Any, flat: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Run one hook call; return its result and the bytes it put through phalanx collectives."""
    phalanx.reset_comm_stats()
    out = hook(state, _bucket(flat.clone())).wait()
    return out, sum(b for _, b in phalanx.comm_stats().values())


def _default_hooks(rank: int) -> dict[str, Any]:
    g = [_grads(0, r) for r in range(WORLD)]
    mean = (g[0] + g[1]) / WORLD
    out, fp32_bytes = _run(allreduce_hook, None, g[rank])
    res: dict[str, Any] = {"exact": torch.equal(out, mean), "fp32_bytes": fp32_bytes}
    for name, hook, u in (
        ("fp16", fp16_compress_hook, 2**-11),
        ("bf16", bf16_compress_hook, 2**-8),
    ):
        out, res[f"{name}_bytes"] = _run(hook, None, g[rank])
        # Three roundings (each a/N, b/N, their sum) of unit roundoff u: |err| <= u(|a|+|b|)(1+u)
        # elementwise, plus fp16's subnormal spacing for entries near zero.
        bound = u * (g[0].abs() + g[1].abs()) * (1 + u) + 1e-7
        res[f"{name}_worst"] = ((out - mean).abs() / bound).max().item()
        res[f"{name}_dtype"] = out.dtype
    return res


def _powersgd(rank: int, singletons: list[dist.ProcessGroup]) -> dict[str, Any]:
    """Bytes per step and parity with one process fed the mean gradient, at ranks 1, 2, 4."""
    res: dict[str, Any] = {}
    for r in (1, 2, 4):
        ours = PowerSGDState(matrix_approximation_rank=r, start_powerSGD_iter=2)
        ref = PowerSGDState(singletons[rank], matrix_approximation_rank=r, start_powerSGD_iter=2)
        worst, sent = 0.0, []
        for step in range(5):
            g = [_grads(step, q) for q in range(WORLD)]
            out, nbytes = _run(powerSGD_hook, ours, g[rank])
            expect, _ = _run(powerSGD_hook, ref, (g[0] + g[1]) / WORLD)
            worst = max(worst, ((out - expect).abs().max() / expect.abs().max()).item())
            sent.append(nbytes)
        res[r] = {
            "bytes": sent,
            "worst_rel": worst,
            "error_numel": ours.error_dict[0].numel(),
            "digest": _digest(out),
        }
    return res


def _topk(rank: int) -> dict[str, Any]:
    state = TopKState(ratio=0.01, start_iter=1)
    g0 = _grads(0, rank)
    _, vanilla = _run(topk_hook, state, g0)
    g = [_grads(1, q) for q in range(WORLD)]
    out, sparse = _run(topk_hook, state, g[rank])  # error memory is still zero at this step
    expect = torch.zeros(NUMEL)
    for q in range(WORLD):
        values, indices = topk_select(g[q], state.k_for(NUMEL))
        expect.index_add_(0, indices, values)
    return {
        "bytes": (vanilla, sparse),
        "exact": torch.equal(out, expect / WORLD),
        "digest": _digest(out),
        "nonzero": out.count_nonzero().item(),
        "error_numel": state.error_dict[0].numel(),
    }


def _hand_built_buckets() -> dict[str, Any]:
    rank = phalanx.world().rank
    singletons = [dist.new_group([r]) for r in range(WORLD)]
    return {
        "default": _default_hooks(rank),
        "powersgd": _powersgd(rank, singletons),
        "topk": _topk(rank),
    }


@pytest.fixture(scope="module")
def buckets() -> list[dict[str, Any]]:
    return run_distributed(_hand_built_buckets, world_size=WORLD, timeout=120)


def test_allreduce_hook_is_the_exact_mean(buckets: list[dict[str, Any]]) -> None:
    assert all(b["default"]["exact"] for b in buckets)


def test_half_precision_hooks_within_rounding_and_half_the_bytes(
    buckets: list[dict[str, Any]],
) -> None:
    for b in buckets:
        d = b["default"]
        assert d["fp32_bytes"] == 4 * NUMEL
        for name in ("fp16", "bf16"):
            assert d[f"{name}_dtype"] == torch.float32
            assert d[f"{name}_bytes"] * 2 == d["fp32_bytes"]
            assert d[f"{name}_worst"] <= 1.0, (name, d[f"{name}_worst"])


@pytest.mark.parametrize("r", [1, 2, 4])
def test_powersgd_matches_one_process_on_the_mean_and_sends_10x_less(
    buckets: list[dict[str, Any]], r: int
) -> None:
    for b in buckets:
        p = b["powersgd"][r]
        vanilla, compressed = p["bytes"][0], p["bytes"][2:]
        assert p["bytes"][:2] == [4 * NUMEL] * 2  # start_powerSGD_iter=2: plain all-reduce
        plain = 4 * (1024 + 1024 + 512 + 256)
        low_rank = 4 * r * (1024 + 2048 + 1024 + 1024 + 512 + 1024 + 256 + 1024)
        assert compressed == [plain + low_rank] * 3
        assert vanilla >= 10 * compressed[0]
        assert p["worst_rel"] < 1e-4, p["worst_rel"]  # float reassociation of the mean only
        assert p["error_numel"] == NUMEL  # memory sized like the bucket, not growing
    assert buckets[0]["powersgd"][r]["digest"] == buckets[1]["powersgd"][r]["digest"]


def test_topk_sends_10x_less_and_averages_every_ranks_top_k(
    buckets: list[dict[str, Any]],
) -> None:
    k = 39_350  # ceil(0.01 * NUMEL)
    for b in buckets:
        t = b["topk"]
        assert t["bytes"] == (4 * NUMEL, 2 * 4 * k)  # k fp32 values + k int32 indices
        assert t["bytes"][0] >= 10 * t["bytes"][1]
        assert t["exact"] and k < t["nonzero"] <= WORLD * k
        assert t["error_numel"] == NUMEL
    assert buckets[0]["topk"]["digest"] == buckets[1]["topk"]["digest"]


# ---------------------------------------------------------------- (b) on torch's DDP, real data


def _digits(rank: int) -> tuple[torch.Tensor, ...]:
    from phalanx.datasets import digits

    x, y = digits()  # scikit-learn's, without importing scikit-learn
    x, y = torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, test = order[:1437], order[1437:]
    mine = train[rank::WORLD]  # each rank its half of the training set
    return x[mine], y[mine], x[test], y[test]


def _hook_cases() -> dict[str, tuple[Any, Any]]:
    return {
        "none": (None, None),
        "allreduce": (None, allreduce_hook),
        "fp16": (None, fp16_compress_hook),
        "bf16": (None, bf16_compress_hook),
        "powerSGD": (
            PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=2),
            powerSGD_hook,
        ),
        "topk": (TopKState(ratio=0.1, start_iter=2), topk_hook),
    }


def _train(
    x: torch.Tensor, y: torch.Tensor, state: Any, hook: Any, epochs: int, engine: str
) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    wrap = torch.nn.parallel.DistributedDataParallel
    ddp = (wrap if engine == "torch" else phalanx.DistributedDataParallel)(model)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    for _ in range(epochs):
        for batch in torch.randperm(len(y), generator=gen).split(64):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x[batch]), y[batch]).backward()
            opt.step()
    return model


def _ddp_digits(epochs: int, engine: str) -> dict[str, Any]:
    x, y, x_test, y_test = _digits(phalanx.world().rank)
    acc, iters = {}, {}
    for name, (state, hook) in _hook_cases().items():
        model = _train(x, y, state, hook, epochs, engine)
        with torch.no_grad():
            acc[name] = (model(x_test).argmax(1) == y_test).float().mean().item() * 100
        iters[name] = getattr(state, "iter", None)
    return {"acc": acc, "iters": iters}


@pytest.mark.parametrize("engine", ["torch", "phalanx"])
def test_every_hook_trains_within_2_points_of_no_hook(engine: str) -> None:
    epochs, steps = 12, 12 * 12  # 719 samples per rank in batches of 64
    res = run_distributed(_ddp_digits, epochs, engine, world_size=WORLD, timeout=120)
    assert res[0] == res[1]  # DDP keeps replicas identical, whatever the hook
    acc = res[0]["acc"]
    assert res[0]["iters"]["powerSGD"] == res[0]["iters"]["topk"] == steps  # compressed 142 times
    assert acc["none"] > 90.0, acc
    for name, value in acc.items():
        assert abs(value - acc["none"]) <= 2.0, (name, acc)
