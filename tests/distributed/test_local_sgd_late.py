"""A late worker with ``late_policy="weighted"`` (``phalanx/local_sgd/late.py``), 2 gloo ranks.

Rank 1 is made 4x slower (``job.slow_down(1, 4.0)``) for its first 8 of 16 steps; every step
also sleeps ``STEP_S`` (a compute stand-in that leaves the loaded CPU free), H = 4.

- Stall: rank 0's seconds blocked in its first two rounds (``SyncStats.sync_seconds``, every
  one with rank 1 slow) stay within about one slow step of rank 1 per round with "weighted";
  with "wait" they are about H·(slow − fast) = 3 slow steps per round.
- Weighted averages equal a one-process simulation fed the rounds' step counts (as every rank
  recorded them), bitwise: LocalSGD, DiLoCo with fp32 and int8 pseudo-gradients. The end of
  training (``flush``) drains: rank 0 joins rank 1's last rounds with weight 0.
- No late worker: every round has H steps on both ranks, the plain average runs, and the
  result is bitwise the "wait" run's.
- Resume: a save right after round 2, resumed in a fresh Job, trains on to the simulation of
  the rounds before the save followed by the resumed run's rounds, bitwise; a save mid-round
  is refused.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

import phalanx
from phalanx.local_sgd import LocalSGDSync, Replica
from phalanx.local_sgd.late import weights_of
from phalanx.local_sgd.quantise import decode, encode
from phalanx.testing import run_distributed
from phalanx.train.strategies.local_sgd import ReplicaRunner
from tests.distributed.local_sgd_cases import BLOCK, OUTER, adamw, batch, make_model

H = 4
STEPS = 16
SLOW_STEPS = 8
"""Rank 1's first SLOW_STEPS steps are 4x slower."""
STEP_S = 0.012
"""Each step's stand-in compute (a sleep)."""
MEASURED = 8
"""Rank 0's sync seconds are read after its own step MEASURED: two rounds, rank 1 slow."""


def _diloco(policy: str, **kw: Any) -> phalanx.DiLoCo:
    return phalanx.DiLoCo(H, OUTER["outer_lr"], OUTER["outer_momentum"], late_policy=policy, **kw)


def _run(
    strategy: phalanx.train.Strategy,
    *,
    slow: int = SLOW_STEPS,
    steps: int = STEPS,
    step_s: float = STEP_S,
    ckpt: str | None = None,
    save_round: int = 0,
    resume_at: int | None = None,
) -> dict[str, Any]:
    """``steps`` steps on this rank's batches (rank 1 slow for its first ``slow``), then
    ``flush``; with ``save_round`` a save right after that round, with ``resume_at`` a
    resume first (this rank took ``resume_at`` steps before the save)."""
    model = make_model()
    job = phalanx.Job(strategy, straggler_check_every=0, checkpoint_dir=ckpt)
    model, _ = job.setup(model, adamw(model), loss_fn=F.mse_loss)
    runner = job.runner
    assert isinstance(runner, ReplicaRunner) and runner.sync is not None
    sync = runner.sync
    out: dict[str, Any] = {}
    first = 0
    if resume_at is not None:
        job.resume()
        first = resume_at
        out["round_after_resume"] = None if sync.late is None else sync.late.round
    if slow > first:
        job.slow_down(1, 4.0)
    ends = [time.perf_counter()]
    for k in range(first, steps):
        time.sleep(step_s)
        job.forward_backward(*batch(job.world.rank, k))
        job.step()
        ends.append(time.perf_counter())
        if k + 1 == slow:
            job.slowdown = None
        if k + 1 == MEASURED:
            out["stall"] = sync.stats.sync_seconds
            out["rounds"] = sync.stats.syncs
        late = sync.late
        at_round = late is not None and late.round == save_round and not sync.steps
        if save_round and at_round and ckpt is not None and "saved_at" not in out:
            job.save(async_=False)
            out["saved_at"] = k + 1
        if k == first and ckpt is not None and resume_at is None and sync.steps:
            with pytest.raises(ValueError, match=r"late_policy='weighted'.*right after a round"):
                job.save(async_=False)
    intervals = [b - a for a, b in itertools.pairwise(ends)]
    out["step_s"] = sorted(intervals[: max(1, slow - first)])[max(0, (slow - first) // 2)]
    drain = time.perf_counter()
    sync.flush()
    out["drain_s"] = time.perf_counter() - drain
    out["history"] = None if sync.late is None else list(sync.late.history)
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["checks"] = (sync.late.checks, sync.stats.check_seconds) if sync.late else (0, 0.0)
    job.close()
    return out


def _every_run(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "wait": _run(_diloco("wait")),
        "weighted": _run(_diloco("weighted")),
        "localsgd": _run(phalanx.LocalSGD(sync_every=H, late_policy="weighted")),
        "int8": _run(_diloco("weighted", quantise="int8", quantise_block=BLOCK)),
        # No late worker: H = 3, 7 steps (the simulation tests' schedule), then a flush.
        "even-wait": _run(phalanx.DiLoCo(3, 0.7, 0.9), slow=0, steps=7),
        # Steps of 40 ms: a rank would have to fall a whole step behind to join early.
        "even": _run(
            phalanx.DiLoCo(3, 0.7, 0.9, late_policy="weighted"), slow=0, steps=7, step_s=0.04
        ),
    }
    ckpt = f"{root}/ckpt"
    out["ref"] = _run(_diloco("weighted"), ckpt=ckpt, save_round=2)
    dist.barrier()
    saved_at = out["ref"]["saved_at"]
    out["resumed"] = _run(_diloco("weighted"), ckpt=ckpt, resume_at=saved_at)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("late"))
    return run_distributed(_every_run, root, world_size=2, timeout=180)


def simulate_rounds(
    rounds: list[tuple[int, ...]], outer: bool, codec: str = "fp32"
) -> list[list[torch.Tensor]]:
    """Both replicas in one process, rank r taking ``counts[r]`` steps in each round, then
    the average weighted by the counts (plain when equal); ``outer``: DiLoCo (an outer step,
    but the average in the last round), else LocalSGD."""
    replicas = [make_model() for _ in range(2)]
    opts = [adamw(m) for m in replicas]
    theta = [p.detach().clone() for p in replicas[0].parameters()]
    outer_opt = torch.optim.SGD(theta, lr=0.7, momentum=0.9, nesterov=True)
    local = [[p.detach() for p in m.parameters()] for m in replicas]
    taken = [0, 0]
    for index, counts in enumerate(rounds):
        for rank, (m, o) in enumerate(zip(replicas, opts)):
            for _ in range(counts[rank]):
                x, y = batch(rank, taken[rank])
                F.mse_loss(m(x), y).backward()
                o.step()
                o.zero_grad(set_to_none=True)
                taken[rank] += 1
        if not sum(counts):
            continue
        w = weights_of(list(counts))
        with torch.no_grad():
            # LocalSGD, and DiLoCo's last round (the flush's final_sync): the average.
            if not outer or index == len(rounds) - 1:
                for a, b in zip(*local):
                    mixed = (a + b) / 2 if w is None else a * w[0] + b * w[1]
                    a.copy_(mixed)
                    b.copy_(mixed)
                continue
            for t, mean in zip(
                theta, _mean([[t - r[i] for i, t in enumerate(theta)] for r in local], w, codec)
            ):
                t.grad = mean
            outer_opt.step()
            for i, t in enumerate(theta):
                t.grad = None
                for r in local:
                    r[i].copy_(t)
    return [[t.clone() for t in r] for r in local]


def _mean(
    deltas: list[list[torch.Tensor]], w: list[float] | None, codec: str
) -> list[torch.Tensor]:
    """Each parameter's mean of the ranks' ``deltas`` (rank, parameter), weighted by ``w``;
    quantised over the flat concatenation (the blocks span parameters, as sent)."""
    flat = [torch.cat([d.reshape(-1) for d in rank]) for rank in deltas]
    if codec == "fp32":
        mean = (flat[0] + flat[1]) / 2 if w is None else flat[0] * w[0] + flat[1] * w[1]
    else:
        total = torch.zeros(flat[0].numel())
        for r, d in enumerate(flat):  # rank order, as every rank decodes
            value = decode(encode(d, codec, BLOCK), codec, d.numel(), BLOCK)
            total += value if w is None else value * w[r]
        mean = total / 2 if w is None else total
    pieces = mean.split([d.numel() for d in deltas[0]])
    return [p.view_as(d) for p, d in zip(pieces, deltas[0])]


def test_weighted_rounds_stall_at_most_about_one_slow_step(runs: list[dict[str, Any]]) -> None:
    slow_step = runs[1]["wait"]["step_s"]  # rank 1's median slowed step
    assert slow_step > 3 * STEP_S, f"rank 1 was not slowed: {slow_step:.3f} s per step"
    for policy in ("wait", "weighted"):
        assert runs[0][policy]["rounds"] == 2, policy
    weighted = runs[0]["weighted"]["stall"] / 2
    wait = runs[0]["wait"]["stall"] / 2
    detail = f"per round: weighted {weighted:.3f} s, wait {wait:.3f} s, slow step {slow_step:.3f} s"
    # Weighted: rank 0 waits for rank 1 to finish the step it is in (at most one slow step).
    assert weighted <= 1.5 * slow_step, detail
    # Wait: rank 0 waits for rank 1's H slow steps less its own H: about 3 slow steps.
    assert wait >= 2 * slow_step, detail
    # In those rounds rank 1 joined after fewer than H steps.
    assert all(c[1] < H for c in runs[0]["weighted"]["history"][:2])


@pytest.mark.parametrize(
    ("name", "outer", "codec"),
    [("weighted", True, "fp32"), ("localsgd", False, "fp32"), ("int8", True, "int8")],
)
def test_weighted_average_equals_a_simulation_of_the_same_rounds(
    name: str, outer: bool, codec: str, runs: list[dict[str, Any]]
) -> None:
    history = runs[0][name]["history"]
    assert history == runs[1][name]["history"], "the ranks saw different rounds"
    assert any(weights_of(list(c)) for c in history), f"no unequal round: {history}"
    assert [sum(c[r] for c in history) for r in (0, 1)] == [STEPS, STEPS]  # every batch once
    want = simulate_rounds(history, outer, codec)
    for rank, got in enumerate(runs):
        for i, (a, b) in enumerate(zip(got[name]["params"], want[rank])):
            assert torch.equal(a, b), f"{name} rank {rank} parameter {i}: {history}"
    # After the drain every replica holds the same model.
    assert all(map(torch.equal, runs[0][name]["params"], runs[1][name]["params"]))


def test_no_late_worker_is_the_wait_policy_bitwise(runs: list[dict[str, Any]]) -> None:
    history = runs[0]["even"]["history"]
    # Rounds of 3 steps, the flush's 1 step; then nothing is left for the drain's last check.
    assert history == [(3, 3), (3, 3), (1, 1)], history
    for rank, got in enumerate(runs):
        for a, b in zip(got["even"]["params"], got["even-wait"]["params"]):
            assert torch.equal(a, b), f"rank {rank}"


def test_resume_after_a_round_is_exact(runs: list[dict[str, Any]]) -> None:
    ref, resumed = runs[0]["ref"], runs[0]["resumed"]
    assert resumed["round_after_resume"] == 2
    rounds = ref["history"][:2] + resumed["history"]
    want = simulate_rounds(rounds, outer=True)
    uninterrupted = simulate_rounds(ref["history"], outer=True)
    for rank, got in enumerate(runs):
        assert got["ref"]["saved_at"] == sum(c[rank] for c in ref["history"][:2])
        for a, b in zip(got["resumed"]["params"], want[rank]):
            assert torch.equal(a, b), f"rank {rank}: resumed {rounds}"
        for a, b in zip(got["ref"]["params"], uninterrupted[rank]):
            assert torch.equal(a, b), f"rank {rank}: uninterrupted {ref['history']}"


def test_bad_late_policy_is_named() -> None:
    with pytest.raises(ValueError, match=r"late_policy.*'drop'"):
        phalanx.DiLoCo(late_policy="drop")
    with pytest.raises(ValueError, match=r"late_policy.*'later'"):
        phalanx.LocalSGD(late_policy="later")
    with pytest.raises(ValueError, match=r"StreamingDiLoCo\(late_policy='weighted'\)"):
        phalanx.StreamingDiLoCo(late_policy="weighted")
    replica = Replica.of(make_model())
    with pytest.raises(ValueError, match=r"LocalSGDSync.*late_policy.*'sometimes'"):
        LocalSGDSync(replica, None, 2, late_policy="sometimes")
    if not dist.is_initialized():
        with pytest.raises(ValueError, match="needs an initialised process group"):
            LocalSGDSync(replica, None, 2, late_policy="weighted")


def test_weights_are_steps_over_their_total_or_none_when_equal() -> None:
    assert weights_of([4, 1]) == [0.8, 0.2]
    assert weights_of([0, 3]) == [0.0, 1.0]
    assert weights_of([3, 3]) is None  # the plain mean: bitwise the "wait" policy's
    assert weights_of([0, 0]) is None


def test_checks_are_cheap(runs: list[dict[str, Any]]) -> None:
    checks, seconds = runs[1]["weighted"]["checks"]
    assert checks > 0
    # A check that waited for the announcement would take about a round (4 fast steps).
    assert seconds / checks < STEP_S / 2, f"{seconds / checks * 1e6:.0f} us per check"
