"""Train a small character-level GPT on Shakespeare with phalanx's DDP.

    phalanx run --standalone --nproc-per-node 2 examples/char_gpt.py
    python examples/char_gpt.py            # one process, no DDP

Each rank draws its own random windows of the training text (seeded by rank); DDP averages the
gradients, so N ranks train on N x --batch-size windows per step. Rank 0 prints train/val loss
every --eval-every steps and a 200-character sample at the end. Exits 1 when the final val loss
is not below the initial one.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn as nn

import phalanx
from phalanx.datasets import CharCorpus, char_corpus, random_windows
from phalanx.models import GPT, GPTConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16, help="windows per rank per step")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default steps/10)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=8, help="batches per rank per estimate")
    p.add_argument("--seed", type=int, default=1337)
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "block_size", "eval_every", "eval_batches"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def build_model() -> GPT:
    """The model ``main`` trains, with the default flags (for ``phalanx plan``)."""
    args = parse_args([])
    config = GPTConfig(char_corpus("shakespeare").vocab_size, args.block_size, args.n_layer,
                       args.n_head, args.n_embd, dropout=args.dropout)  # fmt: skip
    return GPT(config)


def example_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One training micro-batch ``(x, y)`` of ``batch_size`` windows (for ``phalanx plan``)."""
    args = parse_args([])
    train_data, _ = char_corpus("shakespeare").split(0.9)
    return random_windows(train_data, args.block_size, batch_size, torch.Generator().manual_seed(0))


def lr_at(step: int, peak: float, warmup: int, total: int) -> float:
    """Linear warmup to ``peak``, then cosine decay to ``peak / 10`` at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases, LayerNorm gains)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


@torch.no_grad()
def estimate_loss(
    model: GPT, data: torch.Tensor, args: argparse.Namespace, world: phalanx.World
) -> float:
    """Mean loss over fixed windows (the same ones at every call), averaged over the ranks."""
    model.eval()
    g = torch.Generator().manual_seed(args.seed + 7919 * (world.rank + 1))
    losses = []
    for _ in range(args.eval_batches):
        x, y = random_windows(data, args.block_size, args.batch_size, g)
        loss = model(x, y)[1]
        assert loss is not None
        losses.append(loss)
    model.train()
    mean = torch.stack(losses).mean()
    if world.world_size > 1:
        phalanx.all_reduce(mean)
        mean /= world.world_size
    return float(mean)


def train(
    model: GPT,
    ddp: nn.Module,
    train_data: torch.Tensor,
    args: argparse.Namespace,
    rank: int,
    on_eval: Callable[[int], None],
) -> list[float]:
    """Run ``args.steps`` optimizer steps, calling ``on_eval(step)`` every ``--eval-every``.

    Returns the wall time of each step in seconds.
    """
    opt = make_optimizer(model, args.lr)
    warmup = args.steps // 10 if args.warmup is None else args.warmup
    batches = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank its own windows
    times = []
    for step in range(args.steps):
        start = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.lr, warmup, args.steps)
        x, y = random_windows(train_data, args.block_size, args.batch_size, batches)
        _, loss = ddp(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - start)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            on_eval(step + 1)
    return times


def sample_text(model: GPT, corpus: CharCorpus, length: int, seed: int) -> str:
    """``length`` characters sampled from ``model`` after a newline, reproducibly."""
    model.eval()
    prompt = corpus.encode("\n").unsqueeze(0)  # (1, 1)
    out = model.generate(prompt, length, generator=torch.Generator().manual_seed(seed))
    return corpus.decode(out[0, 1:])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world = phalanx.init_process_group()
    corpus = char_corpus("shakespeare")
    train_data, val_data = corpus.split(0.9)
    torch.manual_seed(args.seed)  # same init everywhere (DDP also broadcasts rank 0's)
    config = GPTConfig(corpus.vocab_size, args.block_size, args.n_layer, args.n_head,
                       args.n_embd, dropout=args.dropout)  # fmt: skip
    model = GPT(config)
    ddp: nn.Module = phalanx.DistributedDataParallel(model) if world.world_size > 1 else model

    def log(message: str) -> None:
        if world.is_main:
            print(message, flush=True)

    log(f"GPT {model.num_parameters():,} parameters, vocab {corpus.vocab_size}, world "
        f"{world.world_size} x batch {args.batch_size} x block {args.block_size}")  # fmt: skip
    vals: list[float] = []

    def on_eval(step: int) -> None:
        losses = [estimate_loss(model, d, args, world) for d in (train_data, val_data)]
        log(f"step {step}: train {losses[0]:.2f} val {losses[1]:.2f}")
        vals.append(losses[1])

    on_eval(0)
    times = train(model, ddp, train_data, args, world.rank, on_eval)
    log(f"median step time {1000 * statistics.median(times):.0f} ms")
    if world.is_main:
        log("sample:\n" + sample_text(model, corpus, 200, args.seed))
    phalanx.destroy_process_group()
    if vals[-1] >= vals[0]:
        log(f"FAILED: final val loss {vals[-1]:.3f} is not below the initial {vals[0]:.3f}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
