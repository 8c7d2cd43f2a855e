"""One rank of ``phalanx bench low_bandwidth``: train a small char GPT with one method, report.

Started by the benchmark under ``phalanx run`` in each network namespace of a slow link
(``python -m phalanx.bench.low_bandwidth_worker METHOD OUT_DIR [--steps ...]``). Every method
trains the same GPT from the same initial weights on the same token budget: ``--steps``
batches of ``--batch`` windows per worker, the windows dealt by ``job.loader`` (AdamW, constant
learning rate). Each worker writes ``OUT_DIR/<method>-rank<r>.json``: its wall time, the
validation loss at every ``--eval-every`` steps with the time it was reached, the final
validation loss (after the replica methods' last synchronisation), the bytes its network
namespace sent over the link (``/sys/class/net``, loopback excluded) and the share of its time
it was not waiting for communication.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import torch

import phalanx
from phalanx.datasets import char_corpus, random_windows
from phalanx.models import GPT, GPTConfig
from phalanx.train.strategies.local_sgd import ReplicaRunner

__all__ = ["METHODS", "main", "strategy_for"]

METHODS = ("ddp", "powersgd", "ps_async", "localsgd", "diloco", "diloco_int8", "streaming_diloco")
SEED = 1234


def strategy_for(method: str, sync_every: int, outer_lr: float = 0.7, momentum: float = 0.9) -> Any:
    """The ``phalanx.Job`` strategy of ``method`` (H = ``sync_every`` for the replica ones;
    DiLoCo's outer Nesterov SGD with ``outer_lr`` and ``momentum``)."""
    if method in ("ddp", "powersgd"):
        return phalanx.DDP()
    if method == "ps_async":
        return phalanx.PS(mode="async")
    if method == "localsgd":
        return phalanx.LocalSGD(sync_every=sync_every)
    if method in ("diloco", "diloco_int8"):
        quantise = "int8" if method == "diloco_int8" else "fp32"
        return phalanx.DiLoCo(
            sync_every=sync_every, outer_lr=outer_lr, outer_momentum=momentum, quantise=quantise
        )
    if method == "streaming_diloco":
        return phalanx.StreamingDiLoCo(
            sync_every=sync_every, outer_lr=outer_lr, outer_momentum=momentum, quantise="int8"
        )
    raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")


class Windows(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``n`` fixed random windows of ``data`` (the same for every method and rank)."""

    def __init__(self, data: torch.Tensor, block: int, n: int) -> None:
        g = torch.Generator().manual_seed(SEED)
        self.x, self.y = random_windows(data, block, n, g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def link_tx_bytes() -> int:
    """Bytes sent by this network namespace's interfaces other than loopback."""
    total = 0
    for dev in os.listdir("/sys/class/net"):
        if dev != "lo":
            total += int(Path(f"/sys/class/net/{dev}/statistics/tx_bytes").read_text())
    return total


@torch.no_grad()
def val_loss(model: torch.nn.Module, val: tuple[torch.Tensor, torch.Tensor]) -> float:
    """Mean loss of ``model`` on the validation windows."""
    model.eval()
    _, loss = model(*val)
    model.train()
    return float(loss)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="low_bandwidth_worker", description=__doc__)
    p.add_argument("method", choices=METHODS)
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=400, help="batches per worker")
    p.add_argument("--batch", type=int, default=16, help="windows per batch")
    p.add_argument("--block", type=int, default=64, help="tokens per window")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--sync-every", type=int, default=100, help="H of the replica methods")
    p.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer learning rate")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="DiLoCo's outer momentum")
    p.add_argument("--eval-every", type=int, default=50)
    return p.parse_args(argv)


Batch = tuple[torch.Tensor, torch.Tensor]


def _setup(
    args: argparse.Namespace, job: phalanx.Job
) -> tuple[torch.nn.Module, Iterable[Batch], Batch, int]:
    """The wrapped model, this rank's loader, the validation windows, the number of workers."""
    corpus = char_corpus("shakespeare")
    train, val_data = corpus.data[: int(0.9 * len(corpus.data))], corpus.data[-100_000:]
    torch.manual_seed(SEED)
    gpt = GPT(GPTConfig(corpus.vocab_size, args.block, args.n_layer, 4, args.n_embd))
    opt = torch.optim.AdamW(gpt.parameters(), lr=args.lr, betas=(0.9, 0.95))
    model, _ = job.setup(gpt, opt)
    if args.method == "powersgd":
        from phalanx.data_parallel import DistributedDataParallel, hooks

        assert isinstance(model, DistributedDataParallel)
        state = hooks.PowerSGDState(None, 4, start_powerSGD_iter=10)
        model.register_comm_hook(state, hooks.powerSGD_hook)
    workers = job.world.world_size - (1 if args.method == "ps_async" else 0)
    data = Windows(train, args.block, args.steps * args.batch * workers)
    val = random_windows(val_data, args.block, 64, torch.Generator().manual_seed(SEED + 1))
    loader = cast(Iterable[Batch], job.loader(data, batch_size=args.batch, shuffle=True))
    return model, loader, val, workers


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    torch.set_num_threads(1)
    strategy = strategy_for(args.method, args.sync_every, args.outer_lr, args.outer_momentum)
    job = phalanx.Job(strategy, seed=SEED)
    model, loader, val, workers = _setup(args, job)
    tx0, start = link_tx_bytes(), time.perf_counter()
    curve: list[tuple[float, int, float]] = []
    computing = 0.0  # forward and backward: no communication under PS or the replica methods
    for _ in job.epochs(1):
        for i, batch in enumerate(job.progress(loader)):
            began = time.perf_counter()
            x, y = cast(Batch, batch)
            _, loss = model(x, y)
            job.backward(loss)
            computing += time.perf_counter() - began
            job.step()
            if (i + 1) % args.eval_every == 0:
                curve.append((time.perf_counter() - start, i + 1, val_loss(model, val)))
    sync = job.runner.sync if isinstance(job.runner, ReplicaRunner) else None
    if sync is not None:
        sync.flush()  # every replica holds the synchronised model
    wall = time.perf_counter() - start
    share = job.summary().get("comm_share", math.nan)
    # the strategy's measured wait where it has one (DDP's overlaps backward), else computing
    utilisation = computing / wall if math.isnan(share) else 1.0 - share
    report = {
        "method": args.method,
        "rank": job.world.rank,
        "local_rank": job.world.local_rank,
        "server": job.is_server,
        "workers": workers,
        "wall_s": wall,
        "tx_bytes": link_tx_bytes() - tx0,
        "collective_bytes": None if sync is None else sync.stats.bytes_sent,
        "final_val_loss": None if job.is_server else val_loss(model, val),
        "utilisation": None if job.is_server else utilisation,
        "curve": curve,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.method}-rank{job.world.rank}.json").write_text(json.dumps(report))
    job.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
