"""``phalanx bench activations``: what activation checkpointing saves and costs, on 2 ranks.

examples/char_gpt.py's model (4 blocks, width 128, batch 16 x 64 characters per step) trained
by ``phalanx.Job`` under ZeRO-3 (``"zero3"``, each rank its own batch) and under
``Mesh(pp=2, micro_batches=4)`` (two pipeline stages, 1F1B), each with:

- ``none``: no activation checkpointing;
- ``full`` / ``selective``: ``Job(activation_checkpointing=...)``;
- ``torch-full``: torch's own ``apply_activation_checkpointing`` with its non-reentrant
  ``checkpoint_wrapper`` on the same blocks, the baseline of ``full``.

Rounds interleave the variants: in each round every variant in turn builds its job, takes
``--warmup`` untimed steps, then ``--iters`` timed steps (the slowest rank's time after a
barrier), and one more step under the memory profiler, whose allocation records give the peak
bytes the step held above what was allocated before it (:mod:`phalanx.plan.allocations`: the
activations, the gathered ZeRO-3 units, the gradients and the optimizer's temporaries; the
largest over the ranks). Every variant trains the same model on the same batches, so its losses
must equal ``none``'s bit for bit (``same_losses``). Last line: ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from phalanx.bench.common import Output, add_common_flags, at_least_one, timed
from phalanx.bench.zero import char_batch, char_gpt

__all__ = ["main", "summarize"]

VARIANTS = ("none", "full", "selective", "torch-full")
STRATEGIES = ("zero3", "pp2")
BASELINE = {"full": "torch-full"}


def _strategy(name: str) -> Any:
    import phalanx

    return "zero3" if name == "zero3" else phalanx.Mesh(pp=2, micro_batches=4)


def _lm_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output[0].flatten(0, 1), targets.flatten())


def _torch_checkpointing(model: torch.nn.Module) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    from phalanx.models.gpt import Block

    wrapper = partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, Block)
    )


def _variant(strategy: str, variant: str, cfg: dict[str, Any]) -> dict[str, Any]:
    import phalanx
    from phalanx.plan.allocations import allocations

    model = char_gpt()
    if variant == "torch-full":
        _torch_checkpointing(model)
    ac = variant if variant in ("full", "selective") else None
    job = phalanx.Job(_strategy(strategy), activation_checkpointing=ac)
    job.setup(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        loss_fn=_lm_loss if strategy == "zero3" else None,
    )
    replica = dist.get_rank() if strategy == "zero3" else 0
    losses: list[float] = []

    def step(i: int) -> None:
        x, y = char_batch(replica * 1000 + i, cfg["batch"])
        losses.append(float(job.forward_backward(x, y)))
        job.step()

    for i in range(cfg["warmup"]):
        step(i)
    times = [timed(partial(step, cfg["warmup"] + i)) for i in range(cfg["iters"])]
    _, allocated = allocations(partial(step, cfg["warmup"] + cfg["iters"]))
    job.close()
    peak = torch.tensor([float(allocated.peak)])
    dist.all_reduce(peak, dist.ReduceOp.MAX)
    return {"times": times, "peak": float(peak), "losses": losses}


def _rank_job(cfg: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for round_ in range(cfg["rounds"]):
        for strategy in STRATEGIES:
            names = list(VARIANTS)
            shift = round_ % len(names)
            for variant in names[shift:] + names[:shift]:
                got = _variant(strategy, variant, cfg)
                row = out.setdefault(f"{strategy}/{variant}", {"times": [], "peaks": []})
                row["times"] += got["times"]
                row["peaks"].append(got["peak"])
                row["losses"] = got["losses"]
    return out


def summarize(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per strategy and variant: step time and peak, each against ``none``'s, and
    ``full``'s step time against torch's."""
    rows = []
    for key, r in result.items():
        strategy, variant = key.split("/")
        plain = result[f"{strategy}/none"]
        p50 = statistics.median(r["times"])
        peak = statistics.median(r["peaks"])
        base = BASELINE.get(variant)
        vs_torch = None
        if base is not None:
            vs_torch = p50 / statistics.median(result[f"{strategy}/{base}"]["times"])
        rows.append(
            {
                "strategy": strategy,
                "variant": variant,
                "p50_ms": 1e3 * p50,
                "time_vs_none": p50 / statistics.median(plain["times"]),
                "time_vs_torch": vs_torch,
                "peak_bytes": peak,
                "peak_vs_none": peak / statistics.median(plain["peaks"]),
                "same_losses": r["losses"] == plain["losses"],
            }
        )
    return rows


def _print(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'strategy':<9}{'variant':<12}{'p50 ms':>9}{'vs none':>9}{'vs torch':>10}"
        f"{'peak MB':>9}{'vs none':>9}  same losses"
    )
    for r in rows:
        vs_torch = "-" if r["time_vs_torch"] is None else f"{r['time_vs_torch']:.3f}"
        print(
            f"{r['strategy']:<9}{r['variant']:<12}{r['p50_ms']:>9.2f}{r['time_vs_none']:>9.3f}"
            f"{vs_torch:>10}{r['peak_bytes'] / 1e6:>9.2f}{r['peak_vs_none']:>9.3f}"
            f"  {r['same_losses']}"
        )


def main(argv: list[str] | None = None) -> int:
    """``phalanx bench activations [--quick] [--rounds R] [--iters N] [--batch B] [--out DIR]``."""
    from phalanx.testing import run_distributed

    parser = argparse.ArgumentParser(prog="phalanx bench activations", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="rounds over the variants")
    parser.add_argument("--iters", type=int, default=10, help="timed steps per variant per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--batch", type=int, default=16, help="windows per replica per step")
    add_common_flags(parser, "activations", quick="one round of 2 steps")
    args = parser.parse_args(argv)
    at_least_one(parser, args, "rounds", "iters", "batch")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    cfg = {"rounds": args.rounds, "iters": args.iters, "warmup": args.warmup, "batch": args.batch}
    if args.quick:
        cfg.update(rounds=1, iters=2, warmup=1)
    output = Output.create("activations", args.out, args.json)
    result = run_distributed(_rank_job, cfg, world_size=2, timeout=1800, collective_timeout=300)
    rows = summarize(result[0])
    output.rows(rows)
    _print(rows)
    output.result({"config": {**cfg, "world_size": 2, "model": "char_gpt"}, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
