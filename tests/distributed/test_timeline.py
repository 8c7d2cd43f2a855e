"""A 4-rank job, one rank made 30-60 ms slower in one phase each step: the timeline names it.

Every step after two of warm-up, a rank and a phase drawn at random (the same draw on every
rank) sleep 30 to 60 ms (a sleep frees the CPU, so on 2 cores the others are not slowed too).
The loop is the one people write: ``job.progress(loader)``, ``backward``, ``step``, ``log``.
The merged timeline's critical path must name that rank and phase in at least 95% of those
steps. Each rank's clock is also set off by up to 41 s (``time.time`` shifted in the rank), so
the alignment is exercised, not assumed: the measured offsets must be within 1 ms of the shifts,
and, measured against barriers, no rank may seem to leave a barrier more than 1 ms before the
last one entered it (each barrier has one rank, in turn, enter 5 ms late). A second job's torch
profiler traces, folded into its timeline, must put each rank's forward operators inside that
rank's forward phases.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

import phalanx
from phalanx.bench.timeline import slow_plan, staggered_barriers, train_slowed
from phalanx.diagnostics import critical_path, load_run
from phalanx.diagnostics.chrome_trace import build_trace, rank_pid
from phalanx.diagnostics.job_timeline import current
from phalanx.diagnostics.timeline_cli import make_trace
from phalanx.diagnostics.trace_check import check_trace, ops_by_key
from phalanx.testing import run_distributed, scaled

WORLD, STEPS, WARMUP, BATCH, BARRIERS = 4, 26, 2, 4, 15
SKEW_S = {0: 0.0, 1: 0.731, 2: -2.25, 3: 41.5}


def _train(directory: str, plan: dict[int, tuple[int, str, float]]) -> dict[str, Any]:
    rank = phalanx.world().rank
    real = time.time
    time.time = lambda: real() + SKEW_S[rank]  # this rank's clock is off by seconds
    try:
        return _job(directory, plan)
    finally:
        time.time = real


def _job(directory: str, plan: dict[int, tuple[int, str, float]]) -> dict[str, Any]:
    train_slowed(directory, plan, STEPS, BATCH)
    recorder = current()
    assert recorder is not None
    barriers = staggered_barriers(BARRIERS)
    samples = [(s.offset, s.error) for s in recorder.samples]
    return {"samples": samples, "barriers": barriers}


def test_the_critical_path_names_the_slowed_rank_and_phase(tmp_path: Path) -> None:
    plan = slow_plan(STEPS, seed=7, first=WARMUP + 1)
    results = run_distributed(_train, str(tmp_path), plan, world_size=WORLD, timeout=120)
    run = load_run(tmp_path)
    path = critical_path(run.ranks)
    named = {s.step: (s.rank, s.phase) for s in path.steps}
    hits = [step for step, (r, p, _) in plan.items() if named.get(step) == (r, p)]
    misses = {step: (plan[step][:2], named.get(step)) for step in set(plan) - set(hits)}
    assert len(hits) >= 0.95 * len(plan), f"missed: {misses}"

    # clocks: each measured offset is rank 0's clock minus this rank's, within the error bound
    # it states (half the shortest round trip), and that bound within 1 ms on an idle machine
    for rank, result in enumerate(results):
        for offset, error in result["samples"]:
            truth = SKEW_S[0] - SKEW_S[rank]
            assert abs(offset - truth) <= error + 1e-5, (rank, offset, truth, error)
            assert error <= scaled(1e-3), (rank, error)  # the bound the trace states
    for i in range(BARRIERS):  # nobody leaves a barrier before the last one entered it
        spans = [[run.clocks[r].align(t) for t in results[r]["barriers"][i]] for r in range(WORLD)]
        last_in = max(entered for entered, _ in spans)
        first_out = min(left for _, left in spans)
        assert last_in - first_out <= scaled(1e-3), (i, spans)

    # the trace: one process per rank, every collective on every rank, flows well formed
    doc = build_trace(run, path)
    assert check_trace(doc, world_size=WORLD) == []
    held = ops_by_key(doc)
    assert held and all(pids == {rank_pid(r) for r in range(WORLD)} for pids in held.values())
    assert sum(e["ph"] == "s" for e in doc["traceEvents"]) > STEPS


def _profiled(directory: str) -> None:
    job = phalanx.Job("ddp", timeline_dir=f"{directory}/tl", profile_dir=f"{directory}/prof")
    model, _ = job.setup(nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.TensorDataset(torch.randn(2 * 8 * 10, 64))
    for _ in job.epochs(1):
        for batch in job.progress(job.loader(data, batch_size=8)):
            (x,) = cast(list[torch.Tensor], batch)
            job.backward(model(x).square().mean())
            job.step(opt)
    job.close()


def test_profiler_traces_land_inside_their_ranks_phases(tmp_path: Path) -> None:
    run_distributed(_profiled, str(tmp_path), world_size=2, timeout=60)
    run = load_run(tmp_path / "tl")
    doc, _ = make_trace(run, str(tmp_path / "prof"))
    assert check_trace(doc, world_size=2) == []
    events = doc["traceEvents"]
    for rank in range(2):
        forward = [
            (e["ts"], e["ts"] + e["dur"])
            for e in events
            if e["pid"] == rank_pid(rank) and e["ph"] == "X" and e["name"] == "forward"
        ]
        linear = [e for e in events if e["pid"] == rank_pid(rank) and e["name"] == "aten::linear"]
        assert linear, "the profiler recorded no forward"
        assert all(any(a <= e["ts"] <= b for a, b in forward) for e in linear)
