"""``phalanx bench zero``: phalanx ZeRO against torch's, interleaved in one run on 2 ranks.

On examples/char_gpt.py's model (4 blocks, width 128, ~0.82 M parameters, batch 16 x 64
characters per rank, AdamW), each iteration times one training step (zero_grad, forward,
backward, step) of every implementation in turn, rotating the order, after a barrier; the
slowest rank's time counts. Pairs:

- ``zero1`` (phalanx ZeroRedundancyOptimizer, stage 1) vs ``torch-zero1`` (torch DDP +
  ``torch.distributed.optim.ZeroRedundancyOptimizer``), and phalanx ``zero2`` beside them;
- ``zero3`` (phalanx FullyShardedDataParallel, one unit per block) vs ``torch-fsdp``
  (``fully_shard`` on each block and the root);
- with ``--shm``, ``zero1-shm`` / ``zero2-shm`` / ``zero3-shm``: the same phalanx stages over a
  ``backend="shm"`` group of the same ranks, each against its gloo twin (ZeRO-1/2 stage their
  collectives in the group's shared memory: no copy in or out).

Per implementation it reports p50/p90 step time, the ratio to its baseline (torch's; the gloo
twin for ``-shm``), model-state bytes per rank (parameters, gradients, optimizer state actually
held after a step), bytes the rank handed to collectives per step (phalanx only: counted by
``phalanx.comm_stats()``) and peak memory: CUDA's allocator peak, or on CPU the growth of the
resident set's high-water mark over a few steps (Linux ``clear_refs``; allocator caching makes
it approximate). Last line: ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.bench.common import Output, add_common_flags, at_least_one, timed

__all__ = ["char_batch", "char_gpt", "main", "state_bytes", "train_step"]

BASELINE = {"zero1": "torch-zero1", "zero2": "torch-zero1", "zero3": "torch-fsdp"}
IMPLS = ("torch-zero1", "zero1", "zero2", "torch-fsdp", "zero3")
SHM_IMPLS = ("zero1-shm", "zero2-shm", "zero3-shm")
"""``--shm``: phalanx's ZeRO over a ``backend="shm"`` group of the same ranks; each row's
ratio is to the same stage on gloo."""
BASELINE.update({impl: impl.removesuffix("-shm") for impl in SHM_IMPLS})


def char_gpt() -> nn.Module:
    """examples/char_gpt.py's model (4 blocks, width 128), seeded: the same on every rank."""
    from phalanx.datasets import char_corpus
    from phalanx.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(char_corpus("shakespeare").vocab_size, 64, 4, 4, 128))


def _build(impl: str, shm: Any = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    from phalanx.sharding import ZeroRedundancyOptimizer
    from phalanx.sharding.zero3 import FullyShardedDataParallel

    model = char_gpt()
    kw: dict[str, Any] = {"lr": 3e-3, "weight_decay": 0.1}
    group = shm if impl.endswith("-shm") else None
    impl = impl.removesuffix("-shm")
    if impl in ("zero1", "zero2"):
        return model, ZeroRedundancyOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            parameters_as_bucket_view=True,
            stage=int(impl[-1]),
            process_group=group,
            **kw,
        )
    if impl == "torch-zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return ddp, TorchZero(ddp.parameters(), optimizer_class=torch.optim.AdamW, **kw)
    if impl == "zero3":
        blocks = set(getattr(model, "blocks"))  # noqa: B009
        fsdp = FullyShardedDataParallel(model, wrap=lambda m: m in blocks, process_group=group)
        return fsdp, torch.optim.AdamW(fsdp.parameters(), **kw)
    from torch.distributed.fsdp import fully_shard

    for block in getattr(model, "blocks"):  # noqa: B009
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), **kw)


def char_batch(rank: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` windows of 64 characters of Shakespeare for ``rank``, and their targets."""
    from phalanx.datasets import char_corpus, random_windows

    train, _ = char_corpus("shakespeare").split(0.9)
    return random_windows(train, 64, batch, torch.Generator().manual_seed(rank))


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> None:
    """One training step: zero_grad, forward, backward, step."""
    opt.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    opt.step()


def state_bytes(model: nn.Module, opt: Any) -> dict[str, int]:
    """Bytes held after a step: parameters, gradients (incl. ZeRO-2 shards), optimizer state."""
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    from phalanx.plan import memory_report

    inner = opt.optim if isinstance(opt, TorchZero) else opt  # torch's keeps state in .optim
    report = memory_report(model, inner)
    return {"params": report.params, "grads": report.grads, "optimizer": report.optimizer}


def _peak_growth(fn: Callable[[], None], steps: int) -> float:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
        return float(torch.cuda.max_memory_allocated() - base)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError:
        return float("nan")
    base = _status_kb("VmRSS")
    for _ in range(steps):
        fn()
    return 1024.0 * (_status_kb("VmHWM") - base)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _rank_job(cfg: dict[str, Any]) -> dict[str, Any]:
    import phalanx

    rank = phalanx.world().rank
    x, y = char_batch(rank, cfg["batch"])
    shm = dist.new_group(backend="shm") if set(cfg["impls"]) & set(SHM_IMPLS) else None
    runs = {impl: _build(impl, shm) for impl in cfg["impls"]}
    out: dict[str, Any] = {i: {"times": []} for i in runs}
    for impl, (model, opt) in runs.items():  # memory and bytes first, one at a time
        out[impl]["peak_bytes"] = _peak_growth(partial(train_step, model, opt, x, y), 2)
        phalanx.reset_comm_stats()
        train_step(model, opt, x, y)
        out[impl]["comm_bytes"] = sum(b for _, b in phalanx.comm_stats().values())
        out[impl]["state"] = state_bytes(model, opt)
    names = list(runs)
    for it in range(cfg["warmup"] + cfg["iters"]):
        shift = it % len(names)
        for impl in names[shift:] + names[:shift]:
            model, opt = runs[impl]
            took = timed(partial(train_step, model, opt, x, y))
            if it >= cfg["warmup"]:
                out[impl]["times"].append(took)
    return out


def summarize(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per implementation: times, ratio to its torch baseline, bytes."""
    rows = []
    for impl, r in result.items():
        p50 = statistics.median(r["times"])
        base = BASELINE.get(impl)
        ratio = p50 / statistics.median(result[base]["times"]) if base in result else None
        ordered = sorted(r["times"])
        rows.append(
            {
                "impl": impl,
                "baseline": base,
                "p50_ms": 1e3 * p50,
                "p90_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
                "ratio_vs_torch": ratio,
                "state_bytes": r["state"],
                "model_state_bytes": sum(r["state"].values()),
                "comm_bytes_per_step": r["comm_bytes"] if not impl.startswith("torch") else None,
                "peak_growth_bytes": r["peak_bytes"],
            }
        )
    return rows


def _print(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'impl':<12}{'p50 ms':>9}{'p90 ms':>9}{'vs base':>10}{'states MB':>11}"
        f"{'optim MB':>10}{'comm MB':>9}{'peak+ MB':>10}"
    )
    for r in rows:
        ratio = f"{r['ratio_vs_torch']:.3f}" if r["ratio_vs_torch"] is not None else "-"
        comm = r["comm_bytes_per_step"]
        print(
            f"{r['impl']:<12}{r['p50_ms']:>9.2f}{r['p90_ms']:>9.2f}{ratio:>10}"
            f"{r['model_state_bytes'] / 1e6:>11.2f}{r['state_bytes']['optimizer'] / 1e6:>10.2f}"
            f"{'-' if comm is None else f'{comm / 1e6:.2f}':>9}"
            f"{r['peak_growth_bytes'] / 1e6:>10.1f}"
        )


def main(argv: list[str] | None = None) -> int:
    """``phalanx bench zero [--quick] [--iters N] [--batch B] [--impls ...] [--out DIR]``."""
    from phalanx.testing import run_distributed

    parser = argparse.ArgumentParser(prog="phalanx bench zero", description=__doc__)
    parser.add_argument("--iters", type=int, default=30, help="timed steps per implementation")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--batch", type=int, default=16, help="windows per rank per step")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma list of {IMPLS}")
    parser.add_argument(
        "--shm", action="store_true", help=f"also {', '.join(SHM_IMPLS)} (ZeRO on backend shm)"
    )
    add_common_flags(parser, "zero", quick="a few iterations")
    args = parser.parse_args(argv)
    impls = [i for i in args.impls.split(",") if i]
    bad = [i for i in impls if i not in IMPLS + SHM_IMPLS]
    if bad:
        parser.error(f"--impls has unknown {bad}; choose from {', '.join(IMPLS + SHM_IMPLS)}")
    if args.shm:
        impls += [i for i in SHM_IMPLS if i.removesuffix("-shm") in impls and i not in impls]
    at_least_one(parser, args, "iters", "batch")
    cfg = {"impls": impls, "iters": args.iters, "warmup": args.warmup, "batch": args.batch}
    if args.quick:
        cfg.update(iters=4, warmup=1)
    output = Output.create("zero", args.out, args.json)
    result = run_distributed(_rank_job, cfg, world_size=2, timeout=1800, collective_timeout=300)
    rows = summarize(result[0])  # interleaved: every implementation's row completes at the end
    output.rows(rows)
    _print(rows)
    output.result({"config": {**cfg, "world_size": 2, "model": "char_gpt"}, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
