"""Communication hooks' math in one process (a world of one): PowerSGD and top-k."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

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
from phalanx.data_parallel.hooks.powersgd import orthogonalize_, plan_compression
from phalanx.data_parallel.hooks.topk import topk_select

SHAPES = [(12, 20), (12,), (30, 8), (4, 3, 3, 3), (8,)]


@pytest.fixture(scope="module", autouse=True)
def world_of_one() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
            mp.delenv(var, raising=False)
        with phalanx.process_group("gloo", timeout=10):
            yield


def make_bucket(grads: list[torch.Tensor], index: int = 0, is_last: bool = True) -> GradBucket:
    buffer = torch.cat([g.reshape(-1) for g in grads])
    views, offset = [], 0
    for g in grads:
        views.append(buffer[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    return GradBucket(index, buffer, views, [torch.empty_like(g) for g in grads], is_last)


def random_grads(
    gen: torch.Generator, shapes: list[tuple[int, ...]] = SHAPES
) -> list[torch.Tensor]:
    return [torch.randn(s, generator=gen) for s in shapes]


def run_hook(hook, state, grads: list[torch.Tensor]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return hook(state, make_bucket(grads)).wait().clone()


@pytest.mark.parametrize(("n", "r"), [(50, 1), (50, 3), (7, 7), (64, 4)])
def test_orthogonalize_gives_orthonormal_columns_spanning_the_input(n: int, r: int) -> None:
    a = torch.randn(n, r, generator=torch.Generator().manual_seed(n + r), dtype=torch.float64)
    q = orthogonalize_(a.clone())
    torch.testing.assert_close(q.t() @ q, torch.eye(r, dtype=torch.float64))
    torch.testing.assert_close(q @ (q.t() @ a), a)  # same column space


def test_orthogonalize_keeps_a_zero_column_zero() -> None:
    a = torch.zeros(5, 2)
    a[:, 1] = 1.0
    q = orthogonalize_(a)
    assert not q.isnan().any() and q[:, 0].eq(0).all()
    torch.testing.assert_close(q[:, 1].norm(), torch.tensor(1.0))


def test_plan_compresses_only_matrices_worth_it() -> None:
    plan = plan_compression([(1024, 2048), (1024,), (10, 4), (16, 3, 3, 3), (8, 3, 3, 3)], 4, 2)
    got = [(x.offset, x.n, x.m, x.r) for x in plan.matrices]
    end = 1024 * 2048 + 1024 + 40
    assert got == [(0, 1024, 2048, 4), (end, 16, 27, 4)]
    assert plan.plain == [(1024 * 2048, 1024), (1024 * 2048 + 1024, 40), (end + 432, 216)]


def test_powersgd_at_full_rank_reconstructs_exactly() -> None:
    shapes = [(12, 20), (12,), (30, 8)]  # wide, vector, tall
    grads = random_grads(torch.Generator().manual_seed(0), shapes)
    state = PowerSGDState(
        matrix_approximation_rank=12,
        start_powerSGD_iter=0,
        min_compression_rate=0.5,
        use_error_feedback=False,
        warm_start=False,
    )
    out = run_hook(powerSGD_hook, state, grads)
    assert len(plan_compression(shapes, 12, 0.5).matrices) == 2
    torch.testing.assert_close(out, torch.cat([g.reshape(-1) for g in grads]), atol=1e-5, rtol=0)
    assert state.q_memory_dict == {}  # no warm start: nothing kept


def test_powersgd_low_rank_is_the_projection_onto_p() -> None:
    grads = random_grads(torch.Generator().manual_seed(1), [(40, 30)])
    state = PowerSGDState(
        matrix_approximation_rank=2,
        start_powerSGD_iter=0,
        use_error_feedback=False,
        warm_start=False,
    )
    m = grads[0].clone()
    out = run_hook(powerSGD_hook, state, grads).view(40, 30)
    assert torch.linalg.matrix_rank(out).item() == 2
    u = torch.linalg.svd(out).U[:, :2]
    torch.testing.assert_close(out, u @ (u.t() @ m), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hook", ["powersgd", "topk"])
def test_error_feedback_telescopes(hook: str) -> None:
    """Σ transmitted + final error = Σ inputs: compression delays, never drops."""
    gen = torch.Generator().manual_seed(2)
    if hook == "powersgd":
        state: PowerSGDState | TopKState = PowerSGDState(start_powerSGD_iter=2)
        fn = powerSGD_hook
    else:
        state, fn = TopKState(ratio=0.05, start_iter=2), topk_hook
    sent = inputs = torch.zeros(sum(torch.Size(s).numel() for s in SHAPES), dtype=torch.float64)
    inputs = inputs.clone()
    for _ in range(7):
        grads = random_grads(gen)
        inputs += torch.cat([g.reshape(-1) for g in grads]).double()
        sent += run_hook(fn, state, grads).double()
    error = state.error_dict[0].double()
    assert state.iter == 7 and error.abs().sum() > 1.0  # lossy, so the identity is not trivial
    torch.testing.assert_close(sent + error, inputs, atol=1e-4, rtol=0)


def test_powersgd_memory_is_sized_like_the_bucket_and_restarts_on_rebuild() -> None:
    state = PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=2)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        run_hook(powerSGD_hook, state, random_grads(gen))
    numel = sum(torch.Size(s).numel() for s in SHAPES)
    assert state.error_dict[0].numel() == numel
    assert state.q_memory_dict[0].numel() == (20 + 8) * 2  # (4, 3, 3, 3) is sent plain
    run_hook(powerSGD_hook, state, random_grads(gen, [(6, 50)]))  # bucket 0 rebuilt
    assert state.error_dict[0].numel() == 300 and state.q_memory_dict[0].numel() == 100


def test_powersgd_survives_a_zero_gradient() -> None:
    state = PowerSGDState(start_powerSGD_iter=0, use_error_feedback=False, warm_start=False)
    out = run_hook(powerSGD_hook, state, [torch.zeros(16, 16)])
    assert out.eq(0).all()


def test_topk_select_picks_exactly_the_k_largest_magnitudes() -> None:
    acc = torch.randperm(1000, generator=torch.Generator().manual_seed(4)).float() - 500
    values, indices = topk_select(acc, 37)
    assert values.numel() == 37
    assert set(indices.tolist()) == set(acc.abs().argsort(descending=True)[:37].tolist())
    torch.testing.assert_close(values, acc[indices])
    assert topk_select(acc, 0)[0].numel() == 0 and topk_select(acc, 1000)[0].numel() == 1000


def test_topk_hook_sends_k_entries_and_keeps_the_rest() -> None:
    state = TopKState(ratio=0.1, start_iter=0)
    grads = random_grads(torch.Generator().manual_seed(5))
    flat = torch.cat([g.reshape(-1) for g in grads])
    out = run_hook(topk_hook, state, grads)
    k = state.k_for(flat.numel())
    assert k == 61 and out.count_nonzero().item() == k
    torch.testing.assert_close(out + state.error_dict[0], flat)


def test_default_hooks_in_a_world_of_one() -> None:
    x = torch.randn(100, generator=torch.Generator().manual_seed(6))
    assert torch.equal(run_hook(allreduce_hook, None, [x]), x)
    for hook, dtype in ((fp16_compress_hook, torch.float16), (bf16_compress_hook, torch.bfloat16)):
        out = run_hook(hook, None, [x])
        assert out.dtype == torch.float32
        assert torch.equal(out, x.to(dtype).float())


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: PowerSGDState(matrix_approximation_rank=0), "matrix_approximation_rank=0"),
        (lambda: PowerSGDState(start_powerSGD_iter=1), "start_powerSGD_iter=1"),
        (
            lambda: PowerSGDState(
                start_powerSGD_iter=-1, warm_start=False, use_error_feedback=False
            ),
            "start_powerSGD_iter=-1",
        ),
        (lambda: PowerSGDState(min_compression_rate=0), "min_compression_rate=0"),
        (lambda: PowerSGDState(orthogonalization_epsilon=-1e-8), "orthogonalization_epsilon="),
        (lambda: TopKState(ratio=0), "ratio=0"),
        (lambda: TopKState(ratio=1.5), "ratio=1.5"),
        (lambda: TopKState(start_iter=-2), "start_iter=-2"),
        (lambda: topk_select(torch.zeros(5), 6), "k=6"),
    ],
)
def test_bad_arguments_name_the_argument_and_value(make, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        make()
