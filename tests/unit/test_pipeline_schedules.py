"""Pipeline schedules, the simulator, stage balancing, the header codec; one-process pipelines."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from torch import nn

from phalanx.model_parallel._balance import balance_by_cost
from phalanx.pipeline import (
    Action,
    DeadlockError,
    Pipeline,
    balance_stages,
    interleaved_1f1b,
    parameter_costs,
    schedule,
    simulate,
    split_layers,
    time_costs,
)
from phalanx.pipeline.balance import min_max_cost
from phalanx.pipeline.p2p import HEADER_CAP, decode_header, encode_header
from phalanx.pipeline.schedules import interleaved_warmup
from phalanx.pipeline.stage import Chunk, split_batch

NAMES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zbh1", 1)]


def _all(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    return [schedule(name, p, m, r, v) for r in range(p)]


@pytest.mark.parametrize(("name", "v"), NAMES)
def test_every_action_exactly_once_and_no_deadlock(name: str, v: int) -> None:
    for p, m in itertools.product(range(1, 7), range(1, 13)):
        acts = _all(name, p, m, v)
        kinds = "FIW" if name == "zbh1" else "FB"  # zero bubble: B in two passes, I then W
        want = Counter(Action(k, i, c) for k in kinds for i in range(m) for c in range(v))
        for rank_acts in acts:
            assert Counter(rank_acts) == want, (p, m)
            assert max(Counter(rank_acts).values()) == 1
        simulate(acts)  # raises DeadlockError if some rank could never proceed


@pytest.mark.parametrize(("t_f", "t_b"), [(1.0, 2.0), (1.0, 1.0), (0.5, 3.0)])
def test_gpipe_and_1f1b_makespan_is_the_ideal(t_f: float, t_b: float) -> None:
    for name, p, m in itertools.product(("gpipe", "1f1b"), range(1, 6), range(1, 10)):
        sim = simulate(_all(name, p, m), t_f, t_b)
        assert sim.makespan == pytest.approx((m + p - 1) * (t_f + t_b)), (name, p, m)
        assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


def test_interleaved_beats_1f1b_and_reaches_its_bubble() -> None:
    # Same model: v chunks of 1/v the stage time each. Megatron's bubble (p-1)/(v m + p - 1)
    # for every m >= p, also when m % p != 0.
    for p, m, v in itertools.product(range(2, 6), range(2, 14), (2, 3)):
        if m < p:
            continue
        one = simulate(_all("1f1b", p, m), 1.0, 2.0).makespan
        inter = simulate(_all("interleaved", p, m, v), 1.0 / v, 2.0 / v)
        assert inter.makespan < one, (p, m, v)
        assert inter.makespan == pytest.approx((m + (p - 1) / v) * 3.0), (p, m, v)


def test_in_flight_limits() -> None:
    for p, m in itertools.product(range(1, 6), range(1, 12)):
        assert simulate(_all("gpipe", p, m)).max_in_flight == [m] * p
        assert simulate(_all("1f1b", p, m)).max_in_flight == [min(p - r, m) for r in range(p)]
        for v in (2, 3):
            got = simulate(_all("interleaved", p, m, v)).max_in_flight
            assert got == [min(interleaved_warmup(p, m, r, v) + 1, v * m) for r in range(p)]
            if m % p == 0:  # exactly Megatron-LM's warm-up: (v-1) p + 2 (p-r-1)
                assert got == [min((v - 1) * p + 2 * (p - r - 1) + 1, v * m) for r in range(p)]


def test_zbh1_has_a_third_of_1f1bs_bubble_within_its_peak_memory_and_never_more() -> None:
    for p, m in itertools.product(range(2, 7), range(1, 17)):
        one = simulate(_all("1f1b", p, m), 1.0, 2.0)
        zb = simulate(_all("zbh1", p, m), 1.0, 2.0)  # B = 2 split into I = W = 1
        if m >= p:  # the bubble (p-1)(F+I-W), where 1F1B has (p-1)(F+I+W)
            assert zb.makespan == 3 * m + p - 1, (p, m)
        assert zb.bubble_fraction < one.bubble_fraction, (p, m)
        assert max(zb.max_in_flight) == max(one.max_in_flight) == min(p, m), (p, m)
        for w in (0.0, 0.5, 1.5):  # whatever share of the backward W takes
            assert simulate(_all("zbh1", p, m), 1.0, 2.0, weight_time=w).makespan <= one.makespan
        assert simulate(_all("zbh1", p, m), 1.0, 2.0, weight_time=0.0).makespan == one.makespan


def test_interleaved_with_one_chunk_is_1f1b() -> None:
    assert interleaved_1f1b(4, 6, 1, 1) == schedule("1f1b", 4, 6, 1)


def test_deadlock_names_rank_and_action() -> None:
    # Rank 1 wants micro-batch 1 first; rank 0 sends it only after B0, which needs rank 1.
    bad = [
        [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
        [Action("F", 1), Action("F", 0), Action("B", 0), Action("B", 1)],
    ]
    with pytest.raises(DeadlockError, match=r"rank 0 at B0; rank 1 at F1"):
        simulate(bad)
    with pytest.raises(DeadlockError, match=r"rank 0 at B0"):
        simulate([[Action("B", 0), Action("F", 0)]])


def test_latency_and_uneven_stages() -> None:
    p, m, lat = 3, 4, 0.25
    sim = simulate(_all("gpipe", p, m), 1.0, 2.0, latency=lat)
    assert sim.makespan == pytest.approx((m + p - 1) * 3.0 + 2 * (p - 1) * lat)
    # A slow middle stage (F 2, B 4) sets the pace: stage 0's F0 (1), then stage 1's m * 6
    # plus one idle unit (its F1 ends at 5, its first gradient arrives at 6), then stage 0's
    # last backward (2).
    sim = simulate(_all("1f1b", p, m), [1.0, 2.0, 1.0], [2.0, 4.0, 2.0])
    assert sim.makespan == pytest.approx(1 + m * 6.0 + 1 + 2)
    assert sim.idle[1] == pytest.approx(1 + 1 + 2)


def test_schedule_errors() -> None:
    with pytest.raises(ValueError, match="schedule='pipedream'"):
        schedule("pipedream", 2, 4, 0)
    with pytest.raises(ValueError, match="chunks=2 needs schedule='interleaved'"):
        schedule("1f1b", 2, 4, 0, chunks=2)
    with pytest.raises(ValueError, match="num_microbatches must be an int >= 1, got int 0"):
        schedule("gpipe", 2, 0, 0)
    with pytest.raises(ValueError, match=r"stage must be an int in 0..1, got int 2"):
        schedule("gpipe", 2, 4, 2)


def _brute_force(costs: list[float], k: int) -> float:
    n, best = len(costs), float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


def test_balance_is_optimal_contiguous_and_deterministic() -> None:
    g = torch.Generator().manual_seed(0)
    for n, k in itertools.product(range(1, 9), range(1, 5)):
        if k > n:
            continue
        costs = torch.randint(0, 10, (n,), generator=g).double().tolist()
        sizes = balance_stages(costs, k)
        assert len(sizes) == k and min(sizes) >= 1 and sum(sizes) == n
        starts = [sum(sizes[:i]) for i in range(k + 1)]
        worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(starts))
        assert worst == _brute_force(costs, k), (costs, k, sizes)
        assert balance_stages(costs, k) == sizes
    assert balance_stages([1, 1, 1, 1, 1], 2) == [3, 2]  # ties: earlier stages take more
    assert balance_stages([10, 1, 1, 1, 1], 2) == [1, 4]


def test_min_max_cost_is_the_one_recurrence_of_both_balancers() -> None:
    g = torch.Generator().manual_seed(1)
    for n, k in itertools.product(range(1, 8), range(1, 5)):
        if k > n:
            continue
        costs = torch.randint(0, 9, (n,), generator=g).tolist()
        prefix = [0, *itertools.accumulate(costs)]
        assert min_max_cost(prefix, k) == _brute_force(costs, k), (costs, k)
        split = balance_by_cost(costs, k)  # split_across_devices's tie rule, same bound
        starts = [0, *itertools.accumulate(split)]
        if any(costs):
            worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(starts))
            assert worst == min_max_cost(prefix, k)
    with pytest.raises(ValueError, match=r"parts must be in \[1, 2\], got 3"):
        min_max_cost([0, 1, 2], 3)


def test_balance_errors() -> None:
    with pytest.raises(ValueError, match="more stages than layers: num_stages=4 but only 3"):
        balance_stages([1, 2, 3], 4)
    with pytest.raises(ValueError, match="finite and >= 0"):
        balance_stages([1, -2], 1)
    with pytest.raises(ValueError, match=r"balance=\[2, 2\] must .* sum to the number of layers 5"):
        split_layers([nn.Identity()] * 5, 2, balance=[2, 2])
    with pytest.raises(ValueError, match=r"balance=\[5\] has 1 entries but the pipeline has 2"):
        split_layers([nn.Identity()] * 5, 2, balance=[5])
    with pytest.raises(ValueError, match="balance='time' needs example_input"):
        split_layers([nn.Identity()] * 5, 2, balance="time")


def test_split_layers_policies_and_costs() -> None:
    layers = [nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 4), nn.ReLU(), nn.Linear(4, 4)]
    assert split_layers(layers, 2) == [[0, 1, 2], [3, 4]]
    assert split_layers(layers, 3, balance=[1, 3, 1]) == [[0], [1, 2, 3], [4]]
    assert parameter_costs(layers) == [320.0, 0.0, 260.0, 0.0, 20.0]
    assert split_layers(layers, 2, balance="params") == [[0, 1], [2, 3, 4]]
    costs = time_costs(layers, torch.randn(2, 4))
    assert len(costs) == 5 and all(c > 0 for c in costs)
    assert all(p.grad is None for layer in layers for p in layer.parameters())
    parts = split_layers(layers, 2, balance="time", example_input=torch.randn(2, 4))
    assert [i for part in parts for i in part] == list(range(5))


def test_header_round_trip() -> None:
    ts = [torch.zeros(2, 3, requires_grad=True), torch.zeros(4, dtype=torch.int64)]
    metas = decode_header(encode_header(ts))
    assert [(m.shape, m.dtype, m.requires_grad) for m in metas] == [
        ((2, 3), torch.float32, True),
        ((4,), torch.int64, False),
    ]
    many = [torch.zeros(1, 2, 3, 4, dtype=torch.bfloat16)] * 5  # longer than one message
    values = encode_header(many)
    assert len(values) > HEADER_CAP and values[0] == len(values)
    assert [m.shape for m in decode_header(values)] == [(1, 2, 3, 4)] * 5


def test_chunk_passes_tuples_and_split_batch() -> None:
    class Pair(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x + y, y

    chunk = Chunk([nn.Identity(), Pair(), Pair()], [1, 2])
    assert [n for n, _ in chunk.named_children()] == ["1", "2"]
    out, _ = chunk(torch.ones(2), torch.ones(2))
    assert out.tolist() == [3.0, 3.0]
    pieces = split_batch((torch.arange(6), torch.zeros(6, 2)), 3, "inputs")
    assert len(pieces) == 3 and pieces[1][0].tolist() == [2, 3]
    with pytest.raises(ValueError, match="batch size 6, not divisible by micro_batches=4"):
        split_batch(torch.zeros(6), 4, "inputs")


def _mlp() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2)]


@pytest.mark.parametrize(("name", "v"), NAMES)
def test_one_process_pipeline_matches_the_model(name: str, v: int) -> None:
    """p = 1: several chunks on one rank hand activations over in memory (no process group)."""
    x, y = torch.randn(6, 5), torch.randn(6, 2)
    ref = Chunk(_mlp(), range(5))
    loss = nn.functional.mse_loss(ref(x), y)
    loss.backward()
    pipe = Pipeline(
        _mlp(), None, schedule=name, micro_batches=3, loss_fn=nn.functional.mse_loss, chunks=v
    )
    assert pipe.is_first and pipe.is_last and len(pipe.stages) == v
    # Micro-batching reassociates sums: equal up to float32 rounding.
    torch.testing.assert_close(pipe.step(x, y), loss.detach(), rtol=1e-5, atol=1e-6)
    want = dict(ref.named_parameters())
    for n, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, want[n.split(".", 2)[2]].grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pipe(x), ref(x).detach(), rtol=1e-5, atol=1e-6)


def test_pipeline_argument_errors() -> None:
    kw = {"micro_batches": 2, "loss_fn": nn.functional.mse_loss}
    with pytest.raises(ValueError, match="chunks=2 needs schedule='interleaved'"):
        Pipeline(_mlp(), None, schedule="gpipe", chunks=2, **kw)
    with pytest.raises(ValueError, match="more stages than layers: num_stages=6 but only 5"):
        Pipeline(_mlp(), None, schedule="interleaved", chunks=6, **kw)
    with pytest.raises(ValueError, match=r"balance has 2 stages but the group has 1 ranks"):
        Pipeline(_mlp(), None, balance=[3, 2], **kw)
    pipe = Pipeline(_mlp(), None, **kw)
    with pytest.raises(ValueError, match="inputs has batch size 3, not divisible by"):
        pipe.step(torch.randn(3, 5), torch.randn(3, 2))
    with pytest.raises(ValueError, match="needs targets, got None"):
        pipe.step(torch.randn(4, 5), None)


def test_p2p_mode_by_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    from phalanx.pipeline import runner

    assert runner._p2p_mode(None, None, "interleaved", 2) == "eager"  # no process group: gloo
    monkeypatch.setattr(runner.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(runner.dist, "get_backend", lambda group=None: "nccl")
    assert runner._p2p_mode(None, None, "1f1b", 4) == "grouped"
    assert runner._p2p_mode(None, "eager", "gpipe", 4) == "eager"
    with pytest.raises(ValueError, match="schedule='interleaved' needs the gloo backend"):
        runner._p2p_mode(None, None, "interleaved", 2)
    with pytest.raises(ValueError, match=r"Pipeline\(p2p='fast'\): p2p must be one of"):
        runner.Pipeline(_mlp(), None, micro_batches=2, loss_fn=nn.functional.mse_loss, p2p="fast")
