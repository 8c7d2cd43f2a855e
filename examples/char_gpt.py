"""Train a small character-level GPT on Shakespeare with phalanx's DDP, pipeline or tensor parallel.

    phalanx run --standalone --nproc-per-node 2 examples/char_gpt.py
    phalanx run --standalone --nproc-per-node 4 examples/char_gpt.py --pp 2 --micro-batches 4
    phalanx run --standalone --nproc-per-node 4 examples/char_gpt.py --tp 2
    python examples/char_gpt.py            # one process, no DDP

Each data-parallel replica draws its own random windows of the training text (seeded by its
replica index; the ranks of one replica — its pipeline stages and tensor shards — read the same
windows); gradients are averaged over the replicas, so dp replicas train on dp x --batch-size
windows per step. With --pp / --tp the model is split by ``phalanx.mesh.parallelize`` (tensor
parallel, then pipeline, then data parallel over what remains). Rank 0 prints train/val loss
every --eval-every steps and, when the model is whole, a 200-character sample at the end. Exits
1 when the final val loss is not below the initial one.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
import torch.nn as nn

import phalanx
from phalanx.datasets import CharCorpus, char_corpus, random_windows
from phalanx.mesh import ParallelConfig, ParallelModel, make_groups, parallelize
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
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--micro-batches", type=int, default=None, help="per step (default 4 if --pp)")
    p.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved"))
    args = p.parse_args(argv)
    if args.micro_batches is None:
        args.micro_batches = 4 if args.pp > 1 else 1
    names = ("steps", "batch_size", "block_size", "eval_every", "eval_batches", "pp", "tp")
    for name in names:
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


def make_optimizer(params: Iterable[nn.Parameter], lr: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases, LayerNorm gains)."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


class Trainer:
    """One training step and one loss estimate, for the whole model under DDP or split by
    ``phalanx.mesh.parallelize`` (--pp / --tp)."""

    def __init__(self, model: GPT, world: phalanx.World, args: argparse.Namespace) -> None:
        self.model, self.world = model, world
        self.split: ParallelModel | None = None
        self.replica = world.rank  # seeds this rank's windows: one stream per dp replica
        if args.pp > 1 or args.tp > 1:
            config = ParallelConfig(pp=args.pp, tp=args.tp, micro_batches=args.micro_batches,
                                    schedule=args.schedule)  # fmt: skip
            groups = make_groups(config.topology(world.world_size))
            self.split = parallelize(
                model,
                groups,
                config,
                partial(lm_loss, group=groups.tp, vocab=model.config.vocab_size),
            )
            self.replica = groups.index("dp")
            self.params = list(self.split.parameters())
        else:
            self.ddp = phalanx.DistributedDataParallel(model) if world.world_size > 1 else model
            self.params = list(model.parameters())

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Forward and backward of one batch, gradients averaged and clipped to norm 1."""
        if self.split is not None:
            self.split.train_step(x, y)
            self.split.clip_grad_norm_(1.0)
            return
        _, loss = self.ddp(x, y)
        assert loss is not None
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)

    @torch.no_grad()
    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The batch's mean loss, without gradients."""
        if self.split is not None:
            return self.split.evaluate(x, y)
        loss = self.model(x, y)[1]
        assert loss is not None
        return loss


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, group: Any, vocab: int) -> torch.Tensor:
    """Cross-entropy of (B, T, V) logits; under tensor parallel V is this rank's vocab shard."""
    from phalanx.tensor_parallel import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits, targets, group, vocab_size=vocab)


def estimate_loss(trainer: Trainer, data: torch.Tensor, args: argparse.Namespace) -> float:
    """Mean loss over fixed windows (the same ones at every call), averaged over the replicas."""
    trainer.model.eval()
    g = torch.Generator().manual_seed(args.seed + 7919 * (trainer.replica + 1))
    losses = []
    for _ in range(args.eval_batches):
        x, y = random_windows(data, args.block_size, args.batch_size, g)
        losses.append(trainer.loss(x, y))
    trainer.model.train()
    mean = torch.stack(losses).mean()
    world = trainer.world
    if world.world_size > 1:  # every rank of a replica holds its loss: the world mean is fair
        phalanx.all_reduce(mean)
        mean /= world.world_size
    return float(mean)


def train(
    trainer: Trainer,
    train_data: torch.Tensor,
    args: argparse.Namespace,
    on_eval: Callable[[int], None],
) -> list[float]:
    """Run ``args.steps`` optimizer steps, calling ``on_eval(step)`` every ``--eval-every``.

    Returns the wall time of each step in seconds.
    """
    opt = make_optimizer(trainer.params, args.lr)
    warmup = args.steps // 10 if args.warmup is None else args.warmup
    batches = torch.Generator().manual_seed(args.seed + 1 + trainer.replica)
    times = []
    for step in range(args.steps):
        start = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.lr, warmup, args.steps)
        x, y = random_windows(train_data, args.block_size, args.batch_size, batches)
        opt.zero_grad(set_to_none=True)
        trainer.step(x, y)
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
    n_params = model.num_parameters()  # before the split, which keeps this rank's share
    trainer = Trainer(model, world, args)

    def log(message: str) -> None:
        if world.is_main:
            print(message, flush=True)

    log(f"GPT {n_params:,} parameters, vocab {corpus.vocab_size}, world "
        f"{world.world_size} (pp {args.pp} x tp {args.tp}) x batch {args.batch_size} x block "
        f"{args.block_size}")  # fmt: skip
    vals: list[float] = []

    def on_eval(step: int) -> None:
        losses = [estimate_loss(trainer, d, args) for d in (train_data, val_data)]
        log(f"step {step}: train {losses[0]:.2f} val {losses[1]:.2f}")
        vals.append(losses[1])

    on_eval(0)
    times = train(trainer, train_data, args, on_eval)
    log(f"median step time {1000 * statistics.median(times):.0f} ms")
    if world.is_main and trainer.split is None:  # a split model has no single-rank generate()
        log("sample:\n" + sample_text(model, corpus, 200, args.seed))
    phalanx.destroy_process_group()
    if vals[-1] >= vals[0]:
        log(f"FAILED: final val loss {vals[-1]:.3f} is not below the initial {vals[0]:.3f}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
