"""``phalanx bench tensor_parallel``: phalanx's Megatron layers against torch DTensor, 2 ranks.

Workloads, each at hidden width H (default 512 and 1024), input (8, 128, H), tp=2:

- ``mlp``: fc1 (H -> 4H) column-parallel, GELU, fc2 (4H -> H) row-parallel;
- ``block``: a GPT :class:`~phalanx.models.gpt.Block` (LayerNorms, causal attention with
  separate q/k/v projections, MLP), H/64 heads.

phalanx uses :func:`~phalanx.tensor_parallel.parallelize_module` (``"parallel_input"`` on
``attn`` and ``mlp``: one f each); torch uses ``torch.distributed.tensor.parallel`` with
``ColwiseParallel`` / ``RowwiseParallel`` on the same Linears over a 1-D ``DeviceMesh``. Both
start from the same dense weights. Each iteration times one forward+backward (input requires
grad, as inside a model) of every (workload, implementation) pair, alternating which
implementation goes first, after a barrier; the slowest rank's time counts. Reported: p50 /
p90, the ratio ours/torch, all-reduces per forward+backward (ours: ``phalanx.comm_stats()``;
torch: ``CommDebugMode``), and the largest output difference between the two. Last line:
``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
from functools import partial
from typing import Any

import torch
from torch import nn

from phalanx.bench.common import Output, add_common_flags, at_least_one, timed

__all__ = ["main"]

IMPLS = ("phalanx", "torch-dtensor")
WORKLOADS = ("mlp", "block")
OURS = {
    "mlp": {"fc1": "colwise", "fc2": "rowwise"},
    "block": {
        "attn": "parallel_input",
        "attn.q_proj": "colwise",
        "attn.k_proj": "colwise",
        "attn.v_proj": "colwise",
        "attn.out_proj": "rowwise",
        "mlp": "parallel_input",
        "mlp.fc1": "colwise",
        "mlp.fc2": "rowwise",
    },
}


class _MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = (
            nn.Linear(hidden, 4 * hidden),
            nn.GELU(),
            nn.Linear(4 * hidden, hidden),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _dense(workload: str, hidden: int, seq: int) -> nn.Module:
    from phalanx.models.gpt import Block, GPTConfig

    torch.manual_seed(0)
    if workload == "mlp":
        return _MLP(hidden)
    return Block(GPTConfig(65, seq, 1, max(1, hidden // 64), hidden))


def _torch_plan(workload: str) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    style = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return {k: style[v]() for k, v in OURS[workload].items() if v in style}


def _build(workload: str, hidden: int, seq: int, mesh: Any) -> dict[str, nn.Module]:
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    from phalanx.tensor_parallel import parallelize_module

    dense = _dense(workload, hidden, seq)
    ours = parallelize_module(copy.deepcopy(dense), OURS[workload], dist.group.WORLD)
    theirs = torch_parallelize(copy.deepcopy(dense), mesh, _torch_plan(workload))
    return {"phalanx": ours, "torch-dtensor": theirs}


def _step(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """One forward+backward from zeroed gradients; returns the output."""
    for p in model.parameters():
        p.grad = None
    x.grad = None
    out = model(x)
    out.backward(grad)
    return out.detach()


def _timed_step(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> None:
    _step(model, x, grad)


def _count(impl: str, model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> int:
    """All-reduces one forward+backward issues."""
    import phalanx

    if impl == "phalanx":
        phalanx.reset_comm_stats()
        _step(model, x, grad)
        return phalanx.comm_stats().get("all_reduce", (0, 0))[0]
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as mode:
        _step(model, x, grad)
    return sum(n for op, n in mode.get_comm_counts().items() if "all_reduce" in str(op))


Case = tuple[dict[str, nn.Module], torch.Tensor, torch.Tensor]


def _case(
    cfg: dict[str, Any], workload: str, hidden: int, mesh: Any
) -> tuple[Case, dict[str, Any]]:
    """Build one workload both ways; record their output difference and all-reduce counts."""
    g = torch.Generator().manual_seed(hidden)
    shape = (cfg["batch"], cfg["seq"], hidden)
    x, grad = torch.randn(shape, generator=g).requires_grad_(True), torch.randn(shape, generator=g)
    models = _build(workload, hidden, cfg["seq"], mesh)
    outs = {i: _step(m, x, grad) for i, m in models.items()}
    record: dict[str, Any] = {
        "max_abs_diff": float((outs["phalanx"] - outs["torch-dtensor"]).abs().max())
    }
    for impl, model in models.items():
        record[impl] = {"times": [], "all_reduce": _count(impl, model, x, grad)}
    return (models, x, grad), record


def _rank_job(cfg: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    import phalanx

    mesh = init_device_mesh("cpu", (phalanx.world().world_size,))
    cases: dict[str, Case] = {}
    out: dict[str, Any] = {}
    for workload in cfg["workloads"]:
        for hidden in cfg["hidden"]:
            key = f"{workload}-{hidden}"
            cases[key], out[key] = _case(cfg, workload, hidden, mesh)
    for it in range(cfg["warmup"] + cfg["iters"]):
        for key, (models, x, grad) in cases.items():
            order = IMPLS if it % 2 == 0 else IMPLS[::-1]  # ABAB, then BABA
            for impl in order:
                took = timed(partial(_timed_step, models[impl], x, grad))
                if it >= cfg["warmup"]:
                    out[key][impl]["times"].append(took)
    return out


def summarize(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (workload, width): medians, p90s, ratio ours/torch, all-reduce counts."""
    rows = []
    for key, r in result.items():
        workload, hidden = key.rsplit("-", 1)
        p50 = {i: statistics.median(r[i]["times"]) for i in IMPLS}
        p90 = {
            i: sorted(r[i]["times"])[min(len(r[i]["times"]) - 1, int(0.9 * len(r[i]["times"])))]
            for i in IMPLS
        }
        rows.append(
            {
                "workload": workload,
                "hidden": int(hidden),
                "phalanx_p50_ms": 1e3 * p50["phalanx"],
                "torch_p50_ms": 1e3 * p50["torch-dtensor"],
                "phalanx_p90_ms": 1e3 * p90["phalanx"],
                "torch_p90_ms": 1e3 * p90["torch-dtensor"],
                "ratio_vs_torch": p50["phalanx"] / p50["torch-dtensor"],
                "phalanx_all_reduces": r["phalanx"]["all_reduce"],
                "torch_all_reduces": r["torch-dtensor"]["all_reduce"],
                "max_abs_diff": r["max_abs_diff"],
            }
        )
    return rows


def _print(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'workload':<10}{'H':>6}{'ours ms':>9}{'torch ms':>10}{'ratio':>8}{'ours p90':>10}"
        f"{'torch p90':>11}{'AR ours':>9}{'AR torch':>10}{'max diff':>10}"
    )
    for r in rows:
        print(
            f"{r['workload']:<10}{r['hidden']:>6}{r['phalanx_p50_ms']:>9.2f}"
            f"{r['torch_p50_ms']:>10.2f}{r['ratio_vs_torch']:>8.3f}{r['phalanx_p90_ms']:>10.2f}"
            f"{r['torch_p90_ms']:>11.2f}{r['phalanx_all_reduces']:>9}"
            f"{r['torch_all_reduces']:>10}{r['max_abs_diff']:>10.1e}"
        )


def main(argv: list[str] | None = None) -> int:
    """``phalanx bench tensor_parallel [--quick] [--iters N] [--hidden 512,1024] [--out DIR]``."""
    from phalanx.testing import run_distributed

    parser = argparse.ArgumentParser(prog="phalanx bench tensor_parallel", description=__doc__)
    parser.add_argument("--iters", type=int, default=30, help="timed steps per implementation")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--hidden", default="512,1024", help="comma list of widths")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"from {WORKLOADS}")
    add_common_flags(parser, "tensor_parallel", quick="a few iterations, width 512")
    args = parser.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad:
        parser.error(f"--workloads has unknown {bad}; choose from {', '.join(WORKLOADS)}")
    hidden = [int(h) for h in args.hidden.split(",") if h]
    if any(h < 128 or h % 128 for h in hidden):
        parser.error(
            f"--hidden widths must be multiples of 128 (64-wide heads, tp=2), got {hidden}"
        )
    at_least_one(parser, args, "iters", "batch", "seq")
    cfg: dict[str, Any] = {
        "workloads": workloads,
        "hidden": hidden,
        "iters": args.iters,
        "warmup": args.warmup,
        "batch": args.batch,
        "seq": args.seq,
    }
    if args.quick:
        cfg.update(iters=6, warmup=2, hidden=hidden[:1])
    output = Output.create("tensor_parallel", args.out, args.json)
    result = run_distributed(_rank_job, cfg, world_size=2, timeout=1800, collective_timeout=300)
    rows = summarize(result[0])  # interleaved: every workload's row completes at the end
    output.rows(rows)
    _print(rows)
    output.result({"config": {**cfg, "world_size": 2, "tp": 2}, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
