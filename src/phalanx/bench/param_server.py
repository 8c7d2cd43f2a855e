"""``phalanx bench param_server``: consistency modes against a straggler, on real digits.

Seed 003's question: synchronous training waits for the slowest worker every step; the
asynchronous parameter server does not, at the price of stale gradients. Bounded staleness
(SSP) sits between. Every run trains the same MLP (64-128-10, SGD with momentum 0.9, lr 0.05,
batch 32) on scikit-learn's 8x8 digits (1437 train / 360 test, seeded split) for the same
budget of ``U`` gradients in total:

- ``ddp``: phalanx DDP on 2 ranks, ``U / 2`` steps each (2 gradients per step);
- ``ps-sync``, ``ps-async``, ``ssp2``, ``ssp4``: 1 server + 2 workers (3 processes),
  ``ParameterServer(max_updates=U)``; each worker draws batches with its own seeded generator,
  so a fast worker can keep going.

Each worker step is padded to ``--step-ms`` (default 5 ms) of wall time with a sleep: a stand-in
for a model whose compute, not messaging, dominates a step (on this 2-core machine the MLP itself
takes ~0.3 ms, less than a message round trip). The straggler (``phalanx.train.slowdown``)
then sleeps ``factor - 1`` times the step: ``none``, ``2x`` and ``4x`` slow worker 1 on every
step (a persistently slower machine); ``4x-random`` slows a randomly drawn worker each step
(transient slowness). Sleeping frees the CPU, so the slowdown does not also slow the others.

Measured per run: training wall time, updates/s (gradients applied per second), the time at
which test accuracy first reaches ``--target`` (snapshots of the parameters are cloned during
training with their time stamps and evaluated after it, so evaluation costs no training time),
final test accuracy, the staleness histogram (server-recorded; DDP has none). Each run's row is
printed as it finishes, then a table per straggler setting; ``param_server.json`` and
``param_server.png`` (accuracy against time, unless ``--no-plot``) go to ``--out`` (default: a
new ``runs/bench-param_server-<timestamp>/``; the figures of docs/async.md were made with
``--out benchmarks/results``); last line ``RESULT {json}``. Needs ``pip install 'phalanx[bench]'``
(scikit-learn's digits, matplotlib for the plot), checked before anything runs.

Note the arithmetic of a *persistent* straggler: SSP lets a fast worker run at most ``s``
clocks ahead of the slowest, so over a long run every worker advances at the straggler's pace,
exactly as in sync; SSP's gain is bounded by ``s`` clocks per worker (it shows with transient
stragglers). Async has no such bound.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from phalanx._optional import require
from phalanx.bench.common import Output, add_common_flags

__all__ = ["main"]

MODES = ("ddp", "ps-sync", "ps-async", "ssp2", "ssp4")
STRAGGLERS: dict[str, tuple[float, int | str]] = {
    "none": (1.0, 1),
    "2x": (2.0, 1),
    "4x": (4.0, 1),
    "4x-random": (4.0, "random"),
}
LR, MOMENTUM, BATCH = 0.05, 0.9, 32


def _data() -> tuple[torch.Tensor, ...]:
    from phalanx.datasets import digits

    x, y = digits()  # scikit-learn's, without importing scikit-learn
    xs = torch.tensor(x, dtype=torch.float32) / 16.0
    ys = torch.tensor(y, dtype=torch.int64)
    order = torch.randperm(len(ys), generator=torch.Generator().manual_seed(0))
    tr, te = order[:1437], order[1437:]
    return xs[tr], ys[tr], xs[te], ys[te]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def _sgd(params: Any) -> torch.optim.Optimizer:
    ps = list(params.values()) if isinstance(params, dict) else list(params)
    return torch.optim.SGD(ps, lr=LR, momentum=MOMENTUM)


class _Steps:
    """One worker's batches, padded step time and straggler."""

    def __init__(self, cfg: dict[str, Any], index: int, workers: int) -> None:
        from phalanx.train.slowdown import Slowdown

        self.x, self.y, _, _ = _data()
        self.g = torch.Generator().manual_seed(100 + index)
        factor, who = STRAGGLERS[cfg["straggler"]]
        self.slow = Slowdown(factor, who, index=index, count=workers, seed=7)
        self.step_s = cfg["step_ms"] / 1000.0

    def grad(self, model: nn.Module, step: int) -> torch.Tensor:
        # The padding and the straggler's sleep come between forward and backward: they stand
        # for compute, and DDP's all-reduce (inside backward) must not count as the slow part.
        self.slow.begin()
        t0 = time.perf_counter()
        idx = torch.randint(0, len(self.y), (BATCH,), generator=self.g)
        model.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(self.x[idx]), self.y[idx])
        pad = self.step_s - (time.perf_counter() - t0)
        if pad > 0:
            time.sleep(pad)
        self.slow.end(step)
        loss.backward()
        return loss.detach()


def _ps_job(cfg: dict[str, Any]) -> dict[str, Any]:
    from phalanx.parameter_server import ParameterServer

    mode, bound = {
        "ps-sync": ("sync", None),
        "ps-async": ("async", None),
        "ssp2": ("ssp", 2),
        "ssp4": ("ssp", 4),
    }[cfg["mode"]]
    import torch.distributed as dist

    model = _model()
    steps = _Steps(cfg, max(0, dist.get_rank() - 1), dist.get_world_size() - 1)
    snaps: list[tuple[float, int, torch.Tensor]] = []
    start = [0.0]
    per = 1 if mode == "async" else 2  # gradients per version

    def snapshot(version: int, flat: torch.Tensor) -> None:
        if version * per % cfg["snap_every"] < per:
            snaps.append((time.perf_counter() - start[0], version * per, flat.clone()))

    ps = ParameterServer(
        model, _sgd, mode=mode, bound=bound, max_updates=cfg["updates"], on_version=snapshot
    )
    dist.barrier()  # everyone has its data loaded: the clock starts for all at once
    if ps.is_server:
        start[0] = time.perf_counter()
        report = ps.serve()
        views = [ps.plan.unflatten(f, 0) for _, _, f in snaps]
        return {
            "seconds": report.seconds,
            "applied": report.applied,
            "staleness": report.staleness,
            "snaps": [(t, n, v) for (t, n, _), v in zip(snaps, views)],
        }
    while ps.pull():
        steps.grad(model, ps.worker.clock)  # type: ignore[union-attr]
        ps.push()
    ps.close()
    return {}


def _ddp_job(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    import phalanx

    rank = dist.get_rank()
    steps = _Steps(cfg, rank, 2)
    model = phalanx.DistributedDataParallel(_model())
    opt = _sgd(model.parameters())
    snaps = []
    dist.barrier()
    start = time.perf_counter()
    for step in range(cfg["updates"] // 2):
        steps.grad(model, step)
        opt.step()
        if rank == 0 and (2 * (step + 1)) % cfg["snap_every"] < 2:
            state = {
                n.removeprefix("module."): p.detach().clone() for n, p in model.named_parameters()
            }
            snaps.append((time.perf_counter() - start, 2 * (step + 1), state))
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "applied": cfg["updates"], "staleness": {}, "snaps": snaps}


def _rank_job(cfg: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    return _ddp_job(cfg) if cfg["mode"] == "ddp" else _ps_job(cfg)


def _accuracy(state: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> float:
    model = _model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(state[name].view_as(p))
        return float((model(x).argmax(1) == y).float().mean())


def _summarise(run: dict[str, Any], target: float) -> dict[str, Any]:
    _, _, xt, yt = _data()
    curve = [(t, n, _accuracy(s, xt, yt)) for t, n, s in run["snaps"]]
    reached = next((t for t, _, a in curve if a >= target), None)
    staleness = {int(k): v for k, v in run["staleness"].items()}
    return {
        "seconds": run["seconds"],
        "applied": run["applied"],
        "updates_per_s": run["applied"] / run["seconds"],
        "final_acc": curve[-1][2] if curve else float("nan"),
        "time_to_target_s": reached,
        "staleness": staleness,
        "max_staleness": max(staleness, default=0),
        "curve": [(round(t, 4), n, round(a, 4)) for t, n, a in curve],
    }


def _table(setting: str, rows: dict[str, dict[str, Any]], target: float) -> None:
    sync = rows["ps-sync"]
    print(f"\nstraggler {setting}:")
    print(
        f"{'mode':9} {'upd/s':>8} {'x sync':>7} {'to ' + str(target):>9} {'final acc':>9} "
        f"{'Δ sync pts':>10} {'max stale':>9}"
    )
    for mode, r in rows.items():
        ttt = "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.2f}s"
        ratio, gap = r["updates_per_s"] / sync["updates_per_s"], r["final_acc"] - sync["final_acc"]
        print(
            f"{mode:9} {r['updates_per_s']:8.1f} {ratio:7.2f} {ttt:>9} {r['final_acc']:9.4f} "
            f"{100 * gap:10.2f} {r['max_staleness']:9d}"
        )


def _plot(results: dict[str, dict[str, dict[str, Any]]], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(
        1, len(results), figsize=(4.2 * len(results), 3.6), sharey=True, squeeze=False
    )
    axes = list(grid[0])
    for ax, (setting, rows) in zip(axes, results.items()):
        for mode, r in rows.items():
            ax.plot([t for t, _, _ in r["curve"]], [a for _, _, a in r["curve"]], label=mode)
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"straggler {setting}")
        ax.set_xlabel("seconds")
        ax.set_ylim(0.5, 1.0)
    axes[0].set_ylabel("test accuracy (digits)")
    axes[-1].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _verdict(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    sync = rows["ps-sync"]
    out: dict[str, Any] = {}
    for mode in ("ps-async", "ssp2", "ssp4"):
        key = mode.removeprefix("ps-")
        out[f"{key}_speedup"] = round(rows[mode]["updates_per_s"] / sync["updates_per_s"], 3)
        out[f"{key}_acc_gap_points"] = round(100 * (rows[mode]["final_acc"] - sync["final_acc"]), 2)
    out["async_ge_1_5x"] = out["async_speedup"] >= 1.5
    out["ssp_ge_1_5x"] = min(out["ssp2_speedup"], out["ssp4_speedup"]) >= 1.5
    out["acc_within_1_5_points"] = all(
        abs(out[f"{k}_acc_gap_points"]) <= 1.5 for k in ("async", "ssp2", "ssp4")
    )
    return out


def main(argv: list[str] | None = None) -> int:
    """Run every mode under every straggler setting; print tables, write JSON + PNG, RESULT."""
    from phalanx.testing import run_distributed

    parser = argparse.ArgumentParser(prog="phalanx bench param_server")
    parser.add_argument("--updates", type=int, default=1200, help="gradients per run")
    parser.add_argument("--step-ms", type=float, default=5.0, help="padded worker step time")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--no-plot", action="store_true", help="no PNG (no matplotlib needed)")
    add_common_flags(parser, "param_server", quick="a small budget (smoke test)")
    args = parser.parse_args(argv)
    require("bench", "phalanx bench param_server", ["sklearn"])
    if not args.no_plot:
        require("bench", "phalanx bench param_server's plot (--no-plot skips it)", ["matplotlib"])
    output = Output.create("param_server", args.out, args.json)
    updates = 60 if args.quick else args.updates
    settings = ("4x",) if args.quick else tuple(STRAGGLERS)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    wall = time.perf_counter()
    for setting in settings:
        rows = {}
        for mode in MODES:
            cfg = {
                "mode": mode,
                "straggler": setting,
                "updates": updates,
                "step_ms": 1.0 if args.quick else args.step_ms,
                "snap_every": max(2, updates // 30 // 2 * 2),
            }
            world = 2 if mode == "ddp" else 3
            ranks = run_distributed(
                _rank_job, cfg, world_size=world, timeout=900, collective_timeout=300
            )
            rows[mode] = _summarise(ranks[0], args.target)
            output.rows([{"straggler": setting, "mode": mode, **rows[mode]}])
        results[setting] = rows
        _table(setting, rows, args.target)
    verdicts = {s: _verdict(rows) for s, rows in results.items() if s != "none"}
    payload = {
        "updates": updates,
        "step_ms": args.step_ms,
        "target": args.target,
        "wall_s": round(time.perf_counter() - wall, 1),
        "verdicts": verdicts,
        "runs": results,
    }
    output.write(payload)  # the numbers first: nothing after this can lose them
    if not args.no_plot:
        _plot(results, args.target, output.path("param_server.png"))
    line = {"bench": "param_server", "updates": updates, "target": args.target, **verdicts}
    output.result(payload, line)
    return 0
