"""``phalanx bench pipeline``: phalanx's pipeline schedules against torch.distributed.pipelining.

Stages are calibrated with sleeps: every layer's forward sleeps ``t_f / 2`` and its backward
``t_b / 2`` (custom autograd Functions; sleeping frees the CPU, so 4 ranks on 2 cores measure
the schedule, not the arithmetic), 2 layers per rank, activations (2, 16) per micro-batch. Of
a layer's backward sleep, the ``--weight-share`` (default half) sits on its weight's branch and
the rest on its input's path, as a matrix product's two gradients split its work: a split
backward (ZB-H1's ``I`` and ``W``) pays each part in its own pass.
A GPipe or 1F1B stage (2 layers) then costs ``t_f + t_b`` per micro-batch and an interleaved
chunk (1 layer) half of that. For p in {2, 4} ranks and m in {4, 8, 16} micro-batches, each
iteration times one training step (forward+backward of the batch) of every implementation in
turn, rotating the order (ABAB...), after a barrier; the slowest rank's time counts:

- ours: ``gpipe``, ``1f1b``, ``interleaved`` (chunks=2), ``zbh1`` —
  :class:`phalanx.pipeline.Pipeline`;
- torch: ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B`` and
  ``ScheduleInterleavedZeroBubble`` (one stage per rank) on the same layers.

Per config: median step, the ideal ``(m+p-1)(t_f+t_b)``, the ratio to it (and to the calibrated
ideal: the schedule's own ideal with the measured stage time), measured bubble
``1 - m(t_f+t_b)/step`` against the theoretical ``(p-1)/(m+p-1)`` (``(p-1)/(v m+p-1)``
interleaved; ZB-H1's from :func:`phalanx.pipeline.simulate` of its order), and ours/torch
for the matching schedule: the ratio of medians, and ("paired") the median of per-iteration
ratios of adjacent runs, robust to drift of the machine's speed.
Last line: ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial
from typing import Any

import torch
from torch import nn

from phalanx.bench.common import Output, add_common_flags, timed
from phalanx.bench.sleeps import SlowBackward

__all__ = ["SleepLayer", "main"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbh1")
TORCH_NAME = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zbh1": "ScheduleInterleavedZeroBubble",
}
WIDTH, ROWS = 16, 2  # features, rows per micro-batch
CHUNKS = 2


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward take fixed wall time without using the CPU."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, t_f: float, t_b: float) -> torch.Tensor:
        ctx.t_b = t_b
        time.sleep(t_f)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.t_b)
        return grad.clone(), None, None


class SleepLayer(nn.Module):
    """A tiny Linear (so there are gradients) followed by a sleep of ``t_f`` / ``t_b``; of
    ``t_b``, ``weight_share`` is slept on the weight's branch, the rest on the input's path."""

    def __init__(self, width: int, t_f: float, t_b: float, weight_share: float = 0.5) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.t_f, self.t_i, self.t_w = t_f, t_b * (1 - weight_share), t_b * weight_share

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, width) -> (N, width), after sleeping ``t_f`` (``t_b`` in backward)."""
        weight = SlowBackward.apply(self.lin.weight, self.t_w)
        return _Sleep.apply(nn.functional.linear(x, weight, self.lin.bias), self.t_f, self.t_i)


def _layers(p: int, cfg: dict[str, Any]) -> list[nn.Module]:
    torch.manual_seed(0)
    half_f, half_b = cfg["t_f"] / CHUNKS, cfg["t_b"] / CHUNKS
    return [SleepLayer(WIDTH, half_f, half_b, cfg["weight_share"]) for _ in range(CHUNKS * p)]


def _ours(sched: str, p: int, m: int, cfg: dict[str, Any], group: Any) -> Any:
    from phalanx.pipeline import Pipeline

    chunks = CHUNKS if sched == "interleaved" else 1
    pipe = Pipeline(
        _layers(p, cfg),
        group,
        schedule=sched,
        micro_batches=m,
        loss_fn=nn.functional.mse_loss,
        chunks=chunks,
    )
    return lambda x, y: pipe.step(x, y)


def _torch(sched: str, p: int, m: int, cfg: dict[str, Any], group: Any) -> Any:
    import torch.distributed as dist
    from torch.distributed import pipelining as tpp

    rank, layers = dist.get_rank(group), _layers(p, cfg)
    loss = nn.functional.mse_loss
    if sched == "interleaved":
        ids = [c * p + rank for c in range(CHUNKS)]
        cpu = torch.device("cpu")
        stages: list[Any] = [
            tpp.PipelineStage(layers[s], s, CHUNKS * p, cpu, group=group) for s in ids
        ]
        schedule: Any = tpp.ScheduleInterleaved1F1B(stages, m, loss_fn=loss)
    elif sched == "zbh1":
        mod = nn.Sequential(*layers[CHUNKS * rank : CHUNKS * (rank + 1)])
        stage = tpp.PipelineStage(mod, rank, p, torch.device("cpu"), group=group)
        schedule = tpp.ScheduleInterleavedZeroBubble([stage], m, loss_fn=loss)
    else:
        mod = nn.Sequential(*layers[CHUNKS * rank : CHUNKS * (rank + 1)])
        stage = tpp.PipelineStage(mod, rank, p, torch.device("cpu"), group=group)
        cls = tpp.ScheduleGPipe if sched == "gpipe" else tpp.Schedule1F1B
        schedule = cls(stage, m, loss_fn=loss)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        args = (x,) if rank == 0 else ()
        schedule.step(*args, target=y if rank == p - 1 else None)

    return step


def _config_job(p: int, m: int, cfg: dict[str, Any]) -> dict[str, list[float]]:
    import torch.distributed as dist

    g = torch.Generator().manual_seed(m)
    x, y = torch.randn(m * ROWS, WIDTH, generator=g), torch.randn(m * ROWS, WIDTH, generator=g)
    impls: dict[str, Any] = {}
    for sched in cfg["schedules"]:  # separate groups: no tag can cross between runtimes
        impls[f"ours-{sched}"] = _ours(sched, p, m, cfg, dist.new_group(list(range(p))))
        if cfg["torch"]:
            impls[f"torch-{sched}"] = _torch(sched, p, m, cfg, dist.new_group(list(range(p))))
    times: dict[str, list[float]] = {name: [] for name in impls}
    names = list(impls)
    for it in range(cfg["warmup"] + cfg["iters"]):
        shift = it % len(names)
        for name in names[shift:] + names[:shift]:
            took = timed(partial(impls[name], x, y))
            if it >= cfg["warmup"]:
                times[name].append(took)
    return times


def _measured_unit(p: int, cfg: dict[str, Any]) -> float:
    """Actual forward+backward seconds of one stage on one micro-batch, averaged over ranks.

    Sleeps overshoot (timer slack, wake-up latency, autograd's own work), so this is what an
    ideal schedule would really take per stage; the ratio to it isolates scheduling overhead.
    """
    import phalanx

    stage = nn.Sequential(*_layers(p, cfg)[:CHUNKS])
    x = torch.randn(ROWS, WIDTH)
    runs = []
    for _ in range(8):
        start = time.perf_counter()
        stage(x).sum().backward()
        runs.append(time.perf_counter() - start)
    unit = torch.tensor([statistics.median(runs[2:])])
    phalanx.all_reduce(unit, phalanx.ReduceOp.AVG)
    return float(unit)


def _rank_job(cfg: dict[str, Any]) -> dict[str, Any]:
    import phalanx

    p = phalanx.world().world_size
    unit = _measured_unit(p, cfg)
    return {"unit": unit, "times": {m: _config_job(p, m, cfg) for m in cfg["microbatches"]}}


def summarize(
    p: int, m: int, times: dict[str, list[float]], cfg: dict[str, Any], measured_unit: float
) -> list[dict[str, Any]]:
    """One row per implementation of one (p, m): medians, ideal, bubbles, ratio to torch.

    ``ideal_ms`` is ``(m+p-1)(t_f+t_b)`` from the nominal sleeps; ``calibrated_ms`` is the
    schedule's own ideal, ``(m + (p-1)/v)`` stage times, with the measured stage time.
    """
    unit = cfg["t_f"] + cfg["t_b"]
    ideal = (m + p - 1) * unit
    rows = []
    for name, ts in times.items():
        sched = name.split("-", 1)[1]
        v = CHUNKS if sched == "interleaved" else 1
        step = statistics.median(ts)
        theory = (p - 1) / (v * m + p - 1)
        calibrated = (m + (p - 1) / v) * measured_unit
        if sched == "zbh1":
            span = _zbh1_span(p, m, cfg)
            theory, calibrated = 1 - m / span, span * measured_unit
        twin = times.get(("torch-" if name.startswith("ours") else "ours-") + sched)
        rows.append(
            {
                "p": p,
                "m": m,
                "impl": name,
                "schedule": sched,
                "step_ms": 1e3 * step,
                "ideal_ms": 1e3 * ideal,
                "ratio_to_ideal": step / ideal if ideal else None,
                "calibrated_ms": 1e3 * calibrated,
                "ratio_to_calibrated": step / calibrated if calibrated else None,
                "bubble": 1 - m * unit / step,
                "bubble_theory": theory,
                "ours_over_torch": (
                    step / statistics.median(twin) if twin and name.startswith("ours") else None
                ),
                "ours_over_torch_paired": (
                    statistics.median(a / b for a, b in zip(ts, twin))
                    if twin and name.startswith("ours")
                    else None
                ),
            }
        )
    return rows


def _zbh1_span(p: int, m: int, cfg: dict[str, Any]) -> float:
    """ZB-H1's step in stage times (F + B = 1), simulated with this run's split of B."""
    from phalanx.pipeline import schedule, simulate

    unit = cfg["t_f"] + cfg["t_b"]
    f, b = cfg["t_f"] / unit, cfg["t_b"] / unit
    orders = [schedule("zbh1", p, m, r) for r in range(p)]
    return simulate(orders, f, b, weight_time=b * cfg["weight_share"]).makespan


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _print(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'p':>2}{'m':>4} {'impl':<18}{'step ms':>9}{'ideal ms':>10}{'x ideal':>9}"
        f"{'x calib':>9}{'bubble':>8}{'theory':>8}{'ours/torch':>12}{'paired':>8}"
    )
    for r in rows:
        ratio, paired = _fmt(r["ours_over_torch"]), _fmt(r["ours_over_torch_paired"])
        print(
            f"{r['p']:>2}{r['m']:>4} {r['impl']:<18}{r['step_ms']:>9.1f}{r['ideal_ms']:>10.1f}"
            f"{_fmt(r['ratio_to_ideal']):>9}{_fmt(r['ratio_to_calibrated']):>9}"
            f"{r['bubble']:>8.3f}{r['bubble_theory']:>8.3f}"
            f"{ratio:>12}{paired:>8}"
        )


def _targets(rows: list[dict[str, Any]]) -> dict[str, bool]:
    """The acceptance targets: <= 1.10 x ideal, interleaved and ZB-H1 < 1F1B, ours <= torch."""
    ours = [r for r in rows if r["impl"].startswith("ours")]
    step = {(r["p"], r["m"], r["schedule"]): r["step_ms"] for r in ours}
    inter = [
        step[(p, m, "interleaved")] < step[(p, m, "1f1b")]
        for p, m, s in step
        if s == "interleaved" and (p, m, "1f1b") in step and m >= p
    ]
    zero_bubble = [
        step[(p, m, "zbh1")] < step[(p, m, "1f1b")]
        for p, m, s in step
        if s == "zbh1" and (p, m, "1f1b") in step and p > 1
    ]
    return {
        "within_1.10_of_ideal": all(
            (r["ratio_to_ideal"] or 0) <= 1.10 for r in ours if r["schedule"] in ("gpipe", "1f1b")
        ),
        "interleaved_below_1f1b": bool(inter) and all(inter),
        "zbh1_below_1f1b": bool(zero_bubble) and all(zero_bubble),
        "ours_not_slower_than_torch": all(
            r["ours_over_torch"] <= 1.0 for r in ours if r["ours_over_torch"] is not None
        ),
    }


def main(argv: list[str] | None = None) -> int:
    """``phalanx bench pipeline [--quick] [--iters N] [--t-f S] [--t-b S] [--out DIR]``."""
    from phalanx.testing import run_distributed

    parser = argparse.ArgumentParser(prog="phalanx bench pipeline", description=__doc__)
    parser.add_argument("--iters", type=int, default=15, help="timed steps per implementation")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--t-f", type=float, default=0.020, help="forward seconds per stage")
    parser.add_argument("--t-b", type=float, default=0.040, help="backward seconds per stage")
    parser.add_argument("--ranks", default="2,4", help="comma list of pipeline depths p")
    parser.add_argument("--microbatches", default="4,8,16", help="comma list of m")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="comma list")
    parser.add_argument("--no-torch", action="store_true", help="skip torch's schedules")
    parser.add_argument(
        "--weight-share",
        type=float,
        default=0.5,
        help="share of a layer's backward on its weight's branch (ZB-H1's W), 0..1",
    )
    add_common_flags(parser, "pipeline", quick="p=2, m=4, a few iterations")
    args = parser.parse_args(argv)
    ranks = [int(v) for v in args.ranks.split(",") if v]
    cfg: dict[str, Any] = {
        "t_f": args.t_f,
        "t_b": args.t_b,
        "iters": args.iters,
        "warmup": args.warmup,
        "microbatches": [int(v) for v in args.microbatches.split(",") if v],
        "schedules": [v for v in args.schedules.split(",") if v],
        "torch": not args.no_torch,
        "weight_share": args.weight_share,
    }
    if args.quick:
        ranks = [2]
        cfg.update(iters=2, warmup=1, microbatches=[4])
    if args.iters < 1 or min(ranks) < 1 or min(cfg["microbatches"]) < 1:
        parser.error("--iters, --ranks and --microbatches must be >= 1")
    if not 0 <= args.weight_share <= 1:
        parser.error(f"--weight-share must be in 0..1, got {args.weight_share:g}")
    bad = [s for s in cfg["schedules"] if s not in SCHEDULES]
    if bad:
        parser.error(f"--schedules has unknown {bad}; choose from {', '.join(SCHEDULES)}")
    output = Output.create("pipeline", args.out, args.json)
    rows: list[dict[str, Any]] = []
    for p in ranks:
        result = run_distributed(_rank_job, cfg, world_size=p, timeout=3600, collective_timeout=300)
        for m, times in result[0]["times"].items():
            measured = summarize(p, m, times, cfg, result[0]["unit"])
            output.rows(measured)
            rows += measured
    _print(rows)
    output.result(
        {
            "config": {**cfg, "ranks": ranks, "chunks": CHUNKS},
            "rows": rows,
            "targets": _targets(rows),
        }
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
