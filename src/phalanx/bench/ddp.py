"""``phalanx bench ddp``: phalanx DDP against torch DDP, interleaved in one run on 2 ranks.

Both wrappers train identical copies of the model on the same batches; each iteration times one
step of each, alternating which goes first (ABBA), after a barrier. The slowest rank's time
counts. "Exposed communication" is the step time minus the compute-only time measured with
``no_sync`` (no gradient communication), per implementation. The bytes that each compression
hook puts on the wire per step come from ``phalanx.comm_stats()``. Last line: ``RESULT {json}``.

``--shm`` adds ``phalanx-shm``: phalanx DDP over a ``backend="shm"`` group of the same ranks
(its buckets in the group's shared memory, so their all-reduces copy nothing), interleaved with
the other two; its ``ratio_vs_torch`` is against torch DDP on gloo.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from phalanx.bench.common import Output, add_common_flags, timed

__all__ = ["main"]

CAPS_MB = (1.0, 4.0, 25.0)
SHM = "phalanx-shm"


def mlp() -> nn.Module:
    """About 4.2 M parameters: 1024 -> 2048 -> 1024 -> 10."""
    return nn.Sequential(
        nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def cnn() -> nn.Module:
    """A small CIFAR-style CNN (about 0.3 M parameters)."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 4 * 4, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp": (mlp, (64, 1024)),
    "cnn": (cnn, (32, 3, 32, 32)),
}


def _wrap(impl: str, model: nn.Module, cap: float, shm: Any = None) -> nn.Module:
    import phalanx

    if impl == "torch":
        return torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
    group = shm if impl == SHM else None
    return phalanx.DistributedDataParallel(model, bucket_cap_mb=cap, process_group=group)


def _step(ddp: Any, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()


def _measure(
    model_name: str, cap: float, iters: int, warmup: int, shm: Any = None
) -> dict[str, Any]:
    """On every rank: interleaved step and compute-only times for torch and phalanx DDP (and
    phalanx DDP on the shm group ``shm``, if given); the order rotates every step."""
    factory, shape = MODELS[model_name]
    torch.manual_seed(0)
    base = factory()
    runs: dict[str, tuple[Any, torch.optim.Optimizer]] = {}
    impls = ("torch", "phalanx", SHM) if shm is not None else ("torch", "phalanx")
    for impl in impls:
        m = factory()
        m.load_state_dict(base.state_dict())
        ddp = _wrap(impl, m, cap, shm)
        runs[impl] = (ddp, torch.optim.SGD(ddp.parameters(), lr=0.01))
    x, y = torch.randn(shape), torch.randint(0, 10, (shape[0],))
    times: dict[str, list[float]] = {f"{i}{k}": [] for i in runs for k in ("", "_compute")}
    for it in range(warmup + iters):
        order = impls[it % len(impls) :] + impls[: it % len(impls)]
        for impl in order:
            ddp, opt = runs[impl]

            def one_step(ddp: Any = ddp, opt: torch.optim.Optimizer = opt) -> None:
                _step(ddp, opt, x, y)

            step = timed(one_step)
            with ddp.no_sync():
                compute = timed(one_step)
            if it >= warmup:
                times[impl].append(step)
                times[f"{impl}_compute"].append(compute)
    return times


def _hook_bytes(model_name: str) -> dict[str, float]:
    """Bytes per rank per step sent by each compression hook (phalanx DDP, 25 MB buckets)."""
    import phalanx
    from phalanx.data_parallel import hooks

    factory, shape = MODELS[model_name]
    x, y = torch.randn(shape), torch.randint(0, 10, (shape[0],))
    variants: dict[str, tuple[Any, Any]] = {
        "none": (None, None),
        "fp16": (None, hooks.fp16_compress_hook),
        "bf16": (None, hooks.bf16_compress_hook),
        "powersgd_r1": (hooks.PowerSGDState(None, 1, start_powerSGD_iter=2), hooks.powerSGD_hook),
        "powersgd_r4": (hooks.PowerSGDState(None, 4, start_powerSGD_iter=2), hooks.powerSGD_hook),
        "topk_1pct": (hooks.TopKState(None, ratio=0.01, start_iter=2), hooks.topk_hook),
    }
    out = {}
    for name, (state, hook) in variants.items():
        torch.manual_seed(0)
        ddp = phalanx.DistributedDataParallel(factory())
        if hook is not None:
            ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        for _ in range(3):
            _step(ddp, opt, x, y)
        phalanx.reset_comm_stats()
        _step(ddp, opt, x, y)
        stats = phalanx.comm_stats()
        out[name] = float(sum(b for op, (_, b) in stats.items() if op != "broadcast"))
    return out


def _rank_job(cfg: dict[str, Any], output: Output) -> dict[str, Any]:
    import torch.distributed as dist

    results: dict[str, Any] = {"steps": {}, "bytes": {}}
    shm = dist.new_group(backend="shm") if cfg.get("shm") else None
    for model_name in cfg["models"]:
        for cap in cfg["caps"]:
            key = f"{model_name}/{cap:g}"
            steps = _measure(model_name, cap, cfg["iters"], cfg["warmup"], shm)
            results["steps"][key] = steps
            output.rows(summarize({key: results["steps"][key]}))
        if cfg["hooks"]:
            results["bytes"][model_name] = _hook_bytes(model_name)
    return results


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(steps: dict[str, dict[str, list[float]]]) -> list[dict[str, Any]]:
    """Rows of (model, cap, impl, p50, p90, compute p50, exposed comm, ratio to torch)."""
    rows = []
    for key, t in steps.items():
        model_name, cap = key.split("/")
        torch_p50 = statistics.median(t["torch"])
        for impl in (k for k in t if not k.endswith("_compute")):
            p50 = statistics.median(t[impl])
            compute = statistics.median(t[f"{impl}_compute"])
            rows.append(
                {
                    "model": model_name,
                    "cap_mb": float(cap),
                    "impl": impl,
                    "p50_ms": 1e3 * p50,
                    "p90_ms": 1e3 * _pct(t[impl], 0.9),
                    "compute_ms": 1e3 * compute,
                    "exposed_comm_ms": 1e3 * max(0.0, p50 - compute),
                    "ratio_vs_torch": p50 / torch_p50,
                }
            )
    return rows


def _print_table(rows: list[dict[str, Any]], hook_bytes: dict[str, dict[str, float]]) -> None:
    print(
        f"{'model':<6}{'cap MB':>7}{'impl':>12}{'p50 ms':>9}{'p90 ms':>9}"
        f"{'compute':>9}{'exposed':>9}{'vs torch':>9}"
    )
    for r in rows:
        print(
            f"{r['model']:<6}{r['cap_mb']:>7g}{r['impl']:>12}{r['p50_ms']:>9.2f}"
            f"{r['p90_ms']:>9.2f}{r['compute_ms']:>9.2f}{r['exposed_comm_ms']:>9.2f}"
            f"{r['ratio_vs_torch']:>9.3f}"
        )
    for model_name, by_hook in hook_bytes.items():
        base = by_hook["none"]
        print(f"\nbytes on the wire per rank per step ({model_name}, phalanx DDP):")
        for name, b in by_hook.items():
            print(f"  {name:<12}{b / 1e6:>10.3f} MB   {base / b if b else 0:>7.1f}x less")


def main(argv: list[str] | None = None) -> int:
    """``phalanx bench ddp [--quick] [--iters N] [--models mlp,cnn] [--out DIR]``."""
    from phalanx.testing import run_distributed

    parser = argparse.ArgumentParser(prog="phalanx bench ddp", description=__doc__)
    parser.add_argument("--iters", type=int, default=40, help="timed steps per implementation")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--models", default="mlp,cnn", help="comma list of: mlp, cnn")
    parser.add_argument("--no-hooks", action="store_true", help="skip the compression bytes")
    parser.add_argument("--shm", action="store_true", help=f"add {SHM}: phalanx DDP on shm")
    add_common_flags(parser, "ddp", quick="few iterations, MLP at 25 MB")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    bad = [m for m in models if m not in MODELS]
    if bad or args.iters < 1:
        parser.error(
            f"--models has unknown {bad}" if bad else f"--iters must be >= 1, got {args.iters}"
        )
    cfg = {
        "models": models,
        "caps": CAPS_MB,
        "iters": args.iters,
        "warmup": args.warmup,
        "hooks": not args.no_hooks,
        "shm": args.shm,
    }
    if args.quick:
        cfg.update(models=["mlp"], caps=(25.0,), iters=6, warmup=2)
    output = Output.create("ddp", args.out, args.json)
    result = run_distributed(
        _rank_job, cfg, output, world_size=2, timeout=1800, collective_timeout=300
    )[0]
    rows = summarize(result["steps"])
    _print_table(rows, result["bytes"])
    payload = {
        "config": {**cfg, "caps": list(cfg["caps"]), "world_size": 2},
        "rows": rows,
        "hook_bytes": result["bytes"],
    }
    output.result(payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
